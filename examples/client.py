"""Classify digit images through the router with nothing but the gRPC stubs generated from protos/.

    python examples/client.py --url 127.0.0.1:8001 digit.png [more.png ...]

The same request works from any language: generate stubs from protos/inference/*.proto and send a
ModelInferRequest whose BYTES input is, per image, a 4-byte little-endian length and the file's bytes.
"""

import argparse
import struct
from pathlib import Path

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("images", nargs="+")
parser.add_argument("--url", default="127.0.0.1:8001")
args = parser.parse_args()

images = [Path(path).read_bytes() for path in args.images]
request = pb.ModelInferRequest(model_name="digits")
request.inputs.add(name="IMAGE", datatype="BYTES", shape=[len(images), 1])
request.raw_input_contents.append(b"".join(struct.pack("<I", len(image)) + image for image in images))

with grpc.insecure_channel(args.url) as channel:
    response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)

outputs = {out.name: raw for out, raw in zip(response.outputs, response.raw_output_contents, strict=True)}
labels = np.frombuffer(outputs["LABEL"], dtype="<i8")
scores = np.frombuffer(outputs["SCORES"], dtype="<f4").reshape(len(images), 10)
for path, label, row in zip(args.images, labels, scores, strict=True):
    print(f"{path}: digit {label} (probability {row[label]:.3f})")
