"""TorchServe's handlers: `base_handler.BaseHandler`, which custom handlers subclass."""
