"""A custom TorchServe handler, the hold-out of the TorchServe parity tests: packaged into a `.mar` with
`torch-model-archiver` (or the same layout by `zipfile`), served by TorchServe 0.12 and by the pipeline, and
asked the same requests. It is written as TorchServe's users write handlers: a `BaseHandler` subclass with
its three methods, an extra file it imports, and the context's headers and response status.

Each request's body is text (or a JSON object with a "text" field); the answer counts its words with torch.
Bodies that begin with a command test the other paths:

- "raise": preprocess raises, which fails the whole batch;
- "bytes:", "str:": the answer is returned as bytes or as a string instead of a dict;
- "status:": the answer's status is set to 299 with the context (per request);
- "header:": a response header and the content type are set with the context.

Its methods hand what the next one needs on through their results (the texts go along with the counts), so
it also runs as three stages (`pipeline run --split-handlers`).
"""

import torch
from ts.torch_handler.base_handler import BaseHandler
from word_vocabulary import WEIGHTS  # an extra file of the archive


class WordHandler(BaseHandler):
    def initialize(self, context):
        properties = context.system_properties
        self.manifest = context.manifest
        self.batch_size = properties.get("batch_size")
        self.weights = torch.tensor(WEIGHTS, dtype=torch.float32)
        self.initialized = True

    def preprocess(self, data):
        texts = []
        for row in data:
            body = row.get("data") if row.get("data") is not None else row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = body.decode("utf-8")
            if isinstance(body, dict):
                body = body.get("text", "")
            if body.startswith("raise"):
                raise ValueError("the client asked for an error")
            texts.append(body)
        return texts

    def inference(self, texts):
        counts = torch.tensor([len(text.split()) for text in texts], dtype=torch.float32)
        return counts, counts * self.weights.sum(), texts

    def postprocess(self, inference_output):
        counts, scores, texts = inference_output
        out = []
        for i, (count, score) in enumerate(zip(counts.tolist(), scores.tolist(), strict=True)):
            answer = {
                "words": int(count),
                "score": round(score, 3),
                "model": self.manifest["model"]["modelName"],
            }
            text = texts[i]
            if text.startswith("bytes:"):
                out.append(text.encode("utf-8"))
            elif text.startswith("str:"):
                out.append(text.upper())
            else:
                if text.startswith("status:"):
                    self.context.set_response_status(299, "Counted", idx=i)
                if text.startswith("header:"):
                    self.context.set_response_header(i, "X-Words", str(int(count)))
                    self.context.set_response_content_type(i, "application/vnd.words+json")
                out.append(answer)
        return out
