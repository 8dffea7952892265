"""Fails by raising from execute."""


class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("fail_raise is broken on purpose")
