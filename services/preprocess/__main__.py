"""`python -m services.preprocess`: the Python models (`model.py`) of a model repository that run before
the model service in their ensembles (`pipeline.stage.placement`): decoding, resizing, tokenising."""

from pipeline.stage.service import python_service_main

if __name__ == "__main__":
    python_service_main("preprocess")
