"""`textgen_generate`: a decoupled model, written for Triton's Python backend, that writes text after a
prompt one character at a time and sends each character as a response of its own.

The network is the character-level GRU in `model.pt` beside this file (TorchScript: `forward(tokens, state)`
→ `(logits, state)` and `initial_state(batch)`), trained by the project on a few KB of public-domain text.

`execute` only checks each request and hands it, with its response sender, to the instance's generation
thread, and returns None at once, as a decoupled model may: the thread answers later. The thread keeps every
stream that is generating and runs one step for all of them together, so a request that arrives while
others generate joins them at the next step (the network runs once per step, not once per stream):

- a new stream first reads its prompt (`PROMPT_IDS` [B, L], padding 0 skipped, after a newline so that an
  empty prompt starts at the beginning of a line);
- each step samples the next character of every row (softmax at the `temperature` parameter; 0 takes the
  likeliest), sends it as `TOKEN` [B, 1], and feeds it back. A request's rows stop at their own
  `MAX_TOKENS`; a row that has stopped sends 0 (no character) until the request's longest row is done;
- the request's last response carries the flag `TRITONSERVER_RESPONSE_COMPLETE_FINAL`;
- a request whose client has gone (`is_cancelled()` on its sender) is dropped before the next step, with
  the final flag and nothing else, so the network never computes for a stream nobody reads.

The network runs where Triton's args place the instance: on its GPU (`model_instance_device_id`) when
`model_instance_kind` is GPU and torch sees CUDA, otherwise on the CPU.
"""

import json
import threading
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

NETWORK_FILE = "model.pt"
PAD_ID = 0
#: Fed before every prompt: the corpus's lines start after one.
NEWLINE = 10
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Stream:
    """One request being answered: its sender, the tokens each row may still write, its network state and
    the logits of its next characters."""

    __slots__ = ("logits", "remaining", "sender", "state")

    def __init__(self, sender, remaining):
        self.sender = sender
        self.remaining = remaining
        self.state = None
        self.logits = None


def _parameters(config):
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def _device(args):
    if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
        return torch.device(f"cuda:{args.get('model_instance_device_id', '0')}")
    return torch.device("cpu")


def _error(message, code=pb_utils.TritonError.INVALID_ARG):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _end(stream, response):
    """End `stream` with `response`, as far as its sender still takes one."""
    try:
        stream.sender.send(response, flags=FINAL)
    except Exception as exc:  # its final flag may be sent already: the failure that ended it came after
        pb_utils.Logger.log_warn(f"could not end a stream with {response.error().message()}: {exc}")


class TritonPythonModel:
    """PROMPT_IDS [B, L] (INT64) and MAX_TOKENS [B, 1] (INT32) → one TOKEN [B, 1] (INT64) per response."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                f"{args['model_name']} sends one response per token: it needs model_transaction_policy "
                "{ decoupled: true } in its config"
            )
        parameters = _parameters(config)
        self.temperature = float(parameters.get("temperature", "0.7"))
        self.max_tokens_limit = int(parameters.get("max_tokens_limit", "1024"))
        if self.temperature < 0 or self.max_tokens_limit < 1:
            raise pb_utils.TritonModelException("temperature must be >= 0 and max_tokens_limit >= 1")
        self.device = _device(args)
        path = Path(args["model_repository"]) / args["model_version"] / NETWORK_FILE
        self.network = torch.jit.load(str(path), map_location=self.device).eval()
        self.sampler = torch.Generator(device=self.device).manual_seed(int(parameters.get("seed", "0")))
        with torch.inference_mode():
            probe = torch.tensor([[NEWLINE]], device=self.device)
            self.vocabulary = self.network(probe, self.network.initial_state(1))[0].shape[-1]
        self._arrived = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._generate, name=f"{args['model_name']} generation", daemon=True
        )
        self._thread.start()
        pb_utils.Logger.log_info(f"{args['model_name']}: {path} on {self.device}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompts = pb_utils.get_input_tensor_by_name(request, "PROMPT_IDS").as_numpy()
            limits = pb_utils.get_input_tensor_by_name(request, "MAX_TOKENS").as_numpy().reshape(-1)
            problem = self._check(prompts, limits)
            if problem:
                sender.send(_error(problem), flags=FINAL)
                continue
            stream = _Stream(sender, limits.astype(np.int64))
            with self._wake:
                self._arrived.append((stream, prompts))
                self._wake.notify()
        return None

    def _check(self, prompts, limits):
        if prompts.ndim != 2 or len(limits) != len(prompts):
            return f"PROMPT_IDS [B, L] and MAX_TOKENS [B, 1] expected, got {list(prompts.shape)} and {list(limits.shape)}"
        if ((prompts < 0) | (prompts >= self.vocabulary)).any():
            return f"PROMPT_IDS: ids must be 0..{self.vocabulary - 1}"
        if (limits < 1).any() or (limits > self.max_tokens_limit).any():
            return f"MAX_TOKENS must be 1..{self.max_tokens_limit}, got {limits.tolist()}"
        return None

    def finalize(self):
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _generate(self):
        """The generation thread: admit what arrived, run a step for every stream, until `finalize`."""
        active = []
        while True:
            with self._wake:
                while not (self._arrived or active or self._stopping):
                    self._wake.wait()
                arrived, self._arrived = self._arrived, []
                stopping = self._stopping
            if stopping:
                unloading = _error("the model is unloading", pb_utils.TritonError.UNAVAILABLE)
                for stream in active + [stream for stream, _ in arrived]:
                    _end(stream, unloading)
                return
            try:
                with torch.inference_mode():
                    active += [self._start(stream, prompts) for stream, prompts in arrived]
                    active = self._step([s for s in active if not self._cancelled(s)])
            except Exception as exc:  # every stream ends with the reason, and the thread goes on
                failed = _error(
                    f"generation failed: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL
                )
                for stream in active + [stream for stream, _ in arrived]:
                    _end(stream, failed)
                active = []

    def _cancelled(self, stream):
        if stream.sender.is_cancelled():
            stream.sender.send(flags=FINAL)
            return True
        return False

    def _start(self, stream, prompts):
        """Read each row's prompt (after a newline, padding skipped); the stream's state and logits follow it."""
        states, logits = [], []
        for row in prompts:
            ids = torch.tensor([NEWLINE, *row[row != PAD_ID].tolist()], device=self.device).unsqueeze(0)
            out, state = self.network(ids, self.network.initial_state(1))
            states.append(state)
            logits.append(out[:, -1])
        stream.state = torch.cat(states, dim=1)
        stream.logits = torch.cat(logits)
        return stream

    def _step(self, streams):
        """Sample a character for every row of `streams`, send them and run the network on them; returns the
        streams that go on."""
        if not streams:
            return []
        logits = torch.cat([s.logits for s in streams])
        if self.temperature == 0:
            tokens = logits.argmax(dim=-1)
        else:
            probabilities = torch.softmax(logits / self.temperature, dim=-1)
            tokens = torch.multinomial(probabilities, 1, generator=self.sampler).squeeze(1)
        rows = np.cumsum([len(s.remaining) for s in streams])[:-1]
        going, fed = [], []
        for stream, chosen in zip(streams, np.split(tokens.cpu().numpy(), rows), strict=True):
            chosen = np.where(stream.remaining > 0, chosen, PAD_ID).reshape(-1, 1)
            stream.remaining -= 1
            last = bool((stream.remaining <= 0).all())
            response = pb_utils.InferenceResponse([pb_utils.Tensor("TOKEN", chosen)])
            stream.sender.send(response, flags=FINAL if last else 0)
            if not last:
                going.append(stream)
                fed.append(chosen)
        if going:
            self._advance(going, torch.from_numpy(np.concatenate(fed)).to(self.device))
        return going

    def _advance(self, streams, tokens):
        """One network step for every row of `streams` from `tokens` [rows, 1], the characters they just sent."""
        out, state = self.network(tokens, torch.cat([s.state for s in streams], dim=1))
        at = 0
        for stream in streams:
            rows = len(stream.remaining)
            stream.state = state[:, at : at + rows]
            stream.logits = out[at : at + rows, -1]
            at += rows
