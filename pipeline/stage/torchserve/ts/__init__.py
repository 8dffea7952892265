"""The handler API of TorchServe 0.12, as its handlers import it (`import ts`, `ts.context`,
`ts.torch_handler.base_handler`, `ts.utils.util`), for the handlers this project serves from `.mar` archives.

It is installed as `ts` in `sys.modules` of the service that runs a handler, before the handler is imported
(`pipeline.stage.torchserve.handler_model.install_ts`), and in no other process: a top-level `ts` package in
this distribution would shadow a real TorchServe installed beside it.
"""

__version__ = "0.12.0"
