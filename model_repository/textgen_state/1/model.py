"""`textgen_state`: the textgen GRU as a stateful model (Triton's sequence batching), written for Triton's
Python backend.

A sequence's requests each carry a chunk of ASCII text (`TEXT` [1]); the network reads the chunk on from the
sequence's hidden state and answers the character it expects next (`NEXT`, the likeliest) and the
probabilities of every character (`PROBS` [128]). The hidden state is Triton's implicit state: `HIDDEN`
[1, 128] comes in with each request (zeros on a sequence's first) and `HIDDEN_OUT` goes back to the server,
which hands it to the sequence's next request, so the model keeps nothing between calls and any batch may
mix any sequences. The `START` control input says a request is its sequence's first: the network then reads
a newline first, as generation does (the corpus's lines start after one).

`execute` gets one request per sequence in the batch; it runs the network once for all of them, a step per
character, each row's state standing still once its own chunk has ended (chunks differ in length).

The network is the textgen ensemble's, `model.pt` beside this file (TorchScript: `forward(tokens, state)`
→ `(logits, state)`), written by `make model`.
"""

import json
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

NETWORK_FILE = "model.pt"
#: Read before a sequence's first chunk.
NEWLINE = 10
VOCABULARY = 128


def _device(args):
    if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
        return torch.device(f"cuda:{args.get('model_instance_device_id', '0')}")
    return torch.device("cpu")


def _chunk(request, starts):
    """A request's chunk as token ids (a newline first on a sequence's first request); ValueError for text
    that is not ASCII or is empty."""
    text = bytes(pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)[0])
    ids = np.frombuffer(text, dtype=np.uint8)
    if not ids.size or (ids == 0).any() or (ids > 127).any():
        raise ValueError("TEXT must be ASCII text of at least one character (NUL excluded)")
    return [NEWLINE, *ids.tolist()] if starts else ids.tolist()


class TritonPythonModel:
    """TEXT [1] (BYTES), state HIDDEN [1, 128] → NEXT [1] (BYTES), PROBS [128], state HIDDEN_OUT [1, 128]."""

    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        # Intra-op threads of the process's torch (parameter `threads`): one, unless measured otherwise; two
        # threads per batch this small spin against each other and the server's threads on a small machine.
        torch.set_num_threads(int(parameters.get("threads", {}).get("string_value", "1")))
        self.device = _device(args)
        path = Path(args["model_repository"]) / args["model_version"] / NETWORK_FILE
        self.network = torch.jit.load(str(path), map_location=self.device).eval()

    def execute(self, requests):
        rows, states, failed = [], [], {}
        for i, request in enumerate(requests):
            starts = bool(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)[0])
            try:
                rows.append(_chunk(request, starts))
            except ValueError as exc:
                failed[i] = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                rows.append([NEWLINE])
            states.append(pb_utils.get_input_tensor_by_name(request, "HIDDEN").as_numpy().reshape(1, 1, -1))
        with torch.inference_mode():
            logits, state = self._read(rows, torch.from_numpy(np.concatenate(states, axis=1)).to(self.device))
        probabilities = torch.softmax(logits, dim=-1).cpu().numpy()
        hidden = state.cpu().numpy()
        responses = []
        for i in range(len(requests)):
            if i in failed:
                responses.append(pb_utils.InferenceResponse(error=failed[i]))
                continue
            next_id = int(probabilities[i].argmax())
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("NEXT", np.array([[bytes([next_id])]], dtype=object)),
                        pb_utils.Tensor("PROBS", probabilities[i : i + 1].astype(np.float32)),
                        pb_utils.Tensor("HIDDEN_OUT", hidden[:, i : i + 1].transpose(1, 0, 2).copy()),
                    ]
                )
            )
        return responses

    def _read(self, rows, state):
        """Run every row's ids through the network from its state, a step per position; a row whose ids have
        ended keeps its state and its last logits. Returns the logits after each row's last id and the
        states [1, rows, hidden]."""
        longest = max(len(ids) for ids in rows)
        tokens = torch.zeros((len(rows), longest), dtype=torch.int64)
        lengths = torch.tensor([len(ids) for ids in rows])
        for i, ids in enumerate(rows):
            tokens[i, : len(ids)] = torch.tensor(ids)
        tokens = tokens.to(self.device)
        logits = torch.zeros((len(rows), VOCABULARY), device=self.device)
        for t in range(longest):
            out, stepped = self.network(tokens[:, t : t + 1], state)
            going = (lengths > t).to(self.device)
            state = torch.where(going.view(1, -1, 1), stepped, state)
            logits = torch.where(going.view(-1, 1), out[:, -1], logits)
        return logits, state
