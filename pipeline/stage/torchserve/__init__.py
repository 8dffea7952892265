"""TorchServe's model archives served by the stage runtime: the handler API as TorchServe gives it (the `ts`
package of `ts/`, which handlers import as `ts`) and the model that runs a handler (`handler_model`)."""
