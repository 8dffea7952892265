"""The TorchServe handler `bench.torchserve` serves with TorchServe 0.12 and with `pipeline run --model-store`,
from one `.mar`: the throughput workload's image classifier written as TorchServe's users write handlers (a
`BaseHandler` subclass with its three methods).

Each request's body is a 3x64x64 UINT8 image (12,288 raw bytes); preprocess scales and normalises the batch,
inference runs a fixed-seed three-convolution CNN on one torch thread, postprocess answers each image's top-1
class and its probability as JSON.
"""

import torch
from ts.torch_handler.base_handler import BaseHandler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class ImageClassifier(BaseHandler):
    def initialize(self, context):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(128, 10),
        ).eval()
        self.context = context
        self.initialized = True

    def preprocess(self, data):
        images = []
        for row in data:
            body = row.get("data") if row.get("data") is not None else row.get("body")
            images.append(torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(3, 64, 64))
        batch = torch.stack(images).to(torch.float32).div_(255.0)
        return (batch - MEAN) / STD

    def inference(self, data, *args, **kwargs):
        with torch.inference_mode():
            return self.model(data)

    def postprocess(self, data):
        probabilities, labels = torch.softmax(data, dim=1).max(dim=1)
        return [
            {"label": int(label), "probability": round(float(p), 6)}
            for label, p in zip(labels.tolist(), probabilities.tolist(), strict=True)
        ]
