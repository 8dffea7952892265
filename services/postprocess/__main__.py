"""`python -m services.postprocess`: the Python models (`model.py`) of a model repository that run after
the model service in their ensembles (`pipeline.stage.placement`): softmax, top-k, pooling."""

from pipeline.stage.service import python_service_main

if __name__ == "__main__":
    python_service_main("postprocess")
