"""`python -m services.postprocess`: the Python models (`model.py`) of a model repository that run after
the model service in their ensembles (`pipeline.stage.placement`): softmax, top-k, pooling."""

if __name__ == "__main__":
    from pipeline.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # before the imports that start threads (`pipeline.runtime.allocator`)
    from pipeline.stage.service import python_service_main

    python_service_main("postprocess")
