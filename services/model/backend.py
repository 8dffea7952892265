"""The model service's backend: ONNX, TorchScript, `torch.export` and TensorRT files from a Triton repository.

`ModelBackend.prepare` reads one version of a repository entry: it finds the model file (Triton's default
names, or `default_model_filename`), reads what the file says about its tensors, completes the config from it
where the config is silent (auto-complete) and refuses a config that disagrees, places the instances
(`instance_group`) and picks, for each, the runner that runs the file there:

| file | on a GPU, TensorRT usable | on a GPU otherwise | on the CPU |
|---|---|---|---|
| `model.onnx` | a TensorRT engine built from it (cached) | ONNX Runtime, CUDA provider if installed | ONNX Runtime |
| `model.pt` (TorchScript) | TensorRT through an ONNX export (cached) | PyTorch on CUDA | PyTorch |
| `model.pt2` (`torch.export`) | TensorRT through an ONNX export (cached) | PyTorch on CUDA | PyTorch |
| `model.plan` | TensorRT | refused | refused |

`auto` orders the runners that could run an instance (TensorRT, ONNX Runtime with the CUDA provider, PyTorch
on CUDA, then the CPU), and the first that loads the model runs it (`services.model.fallback`): a runner that
fails to build or load the model hands it to the next with a warning naming why. A config may pin a runner
(`runner`), which then comes first, and may make the choice strict (`strict_runner`, or the service's
`--strict-runner`): the model fails to load instead of falling back. The runner in use and why are shown in
the config (`parameters` `runner_in_use` and `runner_reason`) and in the metrics. Settings live where Triton
keeps them (see `ModelOptions`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.config_fields import acted_on
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import PAD_VALUE_PARAMETER, datatype_of_config, log_ignored
from pipeline.runtime.repository import DEFAULT_FILENAMES, RepositoryEntry
from pipeline.runtime.service_settings import Runners
from pipeline.stage.backend import Instance, PreparedVersion
from pipeline.stage.sequence_config import sequence_tensors
from services.model import tensorrt
from services.model.artifacts import (
    KIND_BACKENDS,
    KIND_PLATFORMS,
    ONNX,
    TENSORRT_PLAN,
    TORCH_EXPORT,
    TORCHSCRIPT,
    Bindings,
    Signature,
    artifact_kind,
    export_signature,
    onnx_signature,
    reconcile,
    torchscript_signature,
)
from services.model.fallback import Choice, FallbackInstance
from services.model.instances import ArtifactInstance, OnnxRuntimeInstance, TorchInstance

log = logging.getLogger(__name__)

RUNNERS = ("auto", "onnxruntime", "torch", "tensorrt")
#: Top-level config fields this backend acts on (`pipeline.protocol.config_fields`); the rest are logged as
#: ignored at load.
ACTED_ON = acted_on("model")
#: `parameters` keys this backend reads (besides the router's `pad_value.<TENSOR>`). Triton's own spellings of
#: the thread count are accepted: the ONNX Runtime backend's and the PyTorch backend's.
PARAMETER_KEYS = (
    "runner",
    "strict_runner",
    "intra_op_thread_count",
    "INTRA_OP_THREAD_COUNT",
    "torch_compile",
)
#: The `parameters` keys under which `ModelConfig` reports which runners run the instances ("onnxruntime on
#: cpu", ...), and why.
RUNNER_KEY, REASON_KEY = "runner_in_use", "runner_reason"
#: The file of a PyTorch model's version that runs as ONNX (`pipeline quantize` writes it).
ONNX_FILENAME = "model.onnx"
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class ModelOptions:
    """A model's settings, read from where Triton keeps such settings in `config.pbtxt`.

    - `parameters { key: "runner" value: { string_value: "auto" } }`: auto | onnxruntime | torch | tensorrt,
      the runner tried first (onnxruntime runs a PyTorch file as its ONNX export).
    - `parameters { key: "strict_runner" value: { string_value: "true" } }`: fail to load instead of falling
      back to the next runner (unset: the service's `--strict-runner`).
    - `parameters { key: "intra_op_thread_count" ... }` (or `INTRA_OP_THREAD_COUNT`): threads per instance.
    - `parameters { key: "torch_compile" value: { string_value: "true" } }`: `torch.compile` the module.
    - `optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt"
      parameters { key: "precision_mode" value: "FP16" } } ] } }`: TensorRT on GPU instances (FP32 or FP16;
      `max_workspace_size_bytes` too), as Triton's ONNX Runtime backend reads it.
    - `gpu_execution_accelerator: [ { name: "auto_mixed_precision" } ]`: PyTorch on CUDA in FP16 (autocast),
      the name Triton's TensorFlow backend gives mixed precision.
    """

    runner: str = "auto"
    threads: int | None = None
    torch_compile: bool = False
    #: `strict_runner`, where the config sets it.
    strict: bool | None = None
    #: A `tensorrt` GPU accelerator is named.
    tensorrt: bool = False
    #: "fp32" or "fp16" (TensorRT's precision_mode, or auto_mixed_precision for torch).
    precision: str = "fp32"
    workspace_bytes: int | None = None

    @classmethod
    def of(cls, config: mc.ModelConfig, source: str) -> ModelOptions:
        """Read and check the settings; `RepositoryError` naming the config and the key for a bad value."""
        params = {key: value.string_value for key, value in config.parameters.items()}
        known = (*PARAMETER_KEYS, RUNNER_KEY, REASON_KEY)
        unknown = sorted(k for k in params if k not in known and not k.startswith(PAD_VALUE_PARAMETER))
        if unknown:
            log.warning(
                "%s: ignoring parameter(s) this service does not act on: %s", source, ", ".join(unknown)
            )
        runner = params.get("runner", "auto").strip().lower()
        runner = "torch" if runner == "pytorch" else runner
        if runner not in RUNNERS:
            raise RepositoryError(
                f"{source}: parameter runner is {runner!r}; expected one of {', '.join(RUNNERS)}"
            )
        threads = None
        raw = params.get("intra_op_thread_count", params.get("INTRA_OP_THREAD_COUNT"))
        if raw is not None:
            if not raw.strip().isdigit() or int(raw) < 1:
                raise RepositoryError(
                    f"{source}: parameter intra_op_thread_count is {raw!r}; expected a whole number >= 1"
                )
            threads = int(raw)
        compile_flag = params.get("torch_compile", "false").strip().lower()
        if compile_flag not in TRUE + FALSE:
            raise RepositoryError(
                f"{source}: parameter torch_compile is {compile_flag!r}; expected true or false"
            )
        strict_flag = params.get("strict_runner", "").strip().lower()
        if strict_flag and strict_flag not in TRUE + FALSE:
            raise RepositoryError(
                f"{source}: parameter strict_runner is {strict_flag!r}; expected true or false"
            )
        tensorrt, precision, workspace = _accelerators(config, source)
        strict = strict_flag in TRUE if strict_flag else None
        return cls(runner, threads, compile_flag in TRUE, strict, tensorrt, precision, workspace)


def _accelerators(config: mc.ModelConfig, source: str) -> tuple[bool, str, int | None]:
    """What the config's `optimization` asks for: whether TensorRT is named, the precision ("fp32" or "fp16")
    and TensorRT's workspace bytes; `RepositoryError` for a precision or workspace TensorRT cannot take,
    a warning for the accelerators and fields this service ignores."""
    tensorrt, precision, workspace = False, "fp32", None
    accelerators = config.optimization.execution_accelerators
    for accelerator in accelerators.gpu_execution_accelerator:
        name = accelerator.name.lower()
        if name == "tensorrt":
            tensorrt = True
            mode = accelerator.parameters.get("precision_mode", "FP32").upper()
            if mode not in ("FP32", "FP16"):
                raise RepositoryError(
                    f"{source}: tensorrt precision_mode is {mode!r}; expected FP32 or FP16"
                    + (
                        " (for INT8, `pipeline quantize` the model: TensorRT runs its QDQ version in INT8)"
                        if mode == "INT8"
                        else ""
                    )
                )
            precision = mode.lower()
            raw = accelerator.parameters.get("max_workspace_size_bytes")
            if raw is not None:
                if not raw.isdigit():
                    raise RepositoryError(f"{source}: tensorrt max_workspace_size_bytes is {raw!r}")
                workspace = int(raw)
            ignored = sorted(set(accelerator.parameters) - {"precision_mode", "max_workspace_size_bytes"})
            if ignored:
                log.warning("%s: ignoring tensorrt accelerator parameter(s): %s", source, ", ".join(ignored))
        elif name == "auto_mixed_precision":
            precision = "fp16"
        else:
            log.warning("%s: ignoring GPU execution accelerator '%s'", source, accelerator.name)
    for accelerator in accelerators.cpu_execution_accelerator:
        log.warning("%s: ignoring CPU execution accelerator '%s'", source, accelerator.name)
    others = [f.name for f, _ in config.optimization.ListFields() if f.name != "execution_accelerators"]
    if others:
        log.warning("%s: ignoring optimization field(s): %s", source, ", ".join(sorted(others)))
    return tensorrt, precision, workspace


@dataclass(frozen=True)
class ModelFile:
    """One version's model file as read, and its config completed from it and checked."""

    #: The completed config, with the sequence batcher's tensors (`declared`: how many of each are the
    #: config's own).
    config: mc.ModelConfig
    artifact: Path
    kind: str
    signature: Signature
    bindings: Bindings
    options: ModelOptions
    declared: tuple[int, int]


class ModelBackend:
    """Prepares versions of the repository entries whose backend is onnxruntime, pytorch or tensorrt."""

    names: tuple[str, ...] = ("onnxruntime", "pytorch", "tensorrt")

    def __init__(self, settings: Runners | None = None, *, repository_root: Path | None = None) -> None:
        self.settings = settings or Runners()
        self.engine_cache = self.settings.engine_cache or (
            (repository_root / ".engines") if repository_root is not None else None
        )

    def read(self, entry: RepositoryEntry, version: str) -> ModelFile:
        """Find and read the version's model file, complete the config from it and check them together.

        A PyTorch model's version folder may hold a `model.onnx` instead of its PyTorch file: the ONNX file
        `pipeline quantize` writes beside a PyTorch version (the version runs on ONNX Runtime).
        """
        config = mc.ModelConfig()
        config.CopyFrom(entry.config)
        source = entry.source
        candidates: tuple[str, ...] = ()
        if config.platform == "pytorch_torch_export":
            candidates = ("model.pt2", "model.pt")
        if entry.backend == "pytorch":
            candidates = (*(candidates or DEFAULT_FILENAMES["pytorch"]), ONNX_FILENAME)
        artifact = entry.artifact(version, candidates)
        kind = artifact_kind(artifact, entry.backend, config.platform)
        if KIND_BACKENDS[kind] != entry.backend and not (kind == ONNX and entry.backend == "pytorch"):
            raise RepositoryError(
                f"{source}: {artifact.name} is a {KIND_PLATFORMS[kind]} file, but the model's backend is "
                f"{entry.backend}"
            )
        options = ModelOptions.of(config, source)
        if kind == TENSORRT_PLAN:
            usable, why = tensorrt.tensorrt_status()
            if not usable:
                raise RepositoryError(
                    f"{artifact}: a TensorRT engine needs TensorRT and a CUDA GPU, and {why}"
                )
        signature = read_signature(artifact, kind)
        # A sequence batcher's control and state tensors are the model file's too: bound like the others,
        # and left out of the config clients read (as Triton lists them under sequence_batching only).
        declared = len(config.input), len(config.output)
        if config.HasField("sequence_batching"):
            if not (config.input and config.output):
                raise RepositoryError(
                    f"{source}: a model with sequence_batching declares its inputs and outputs in its config "
                    "(they cannot be completed from a model file that also has control and state tensors)"
                )
            added_inputs, added_outputs = sequence_tensors(config)
            config.input.extend(added_inputs)
            config.output.extend(added_outputs)
        bindings = reconcile(
            config,
            signature,
            artifact=artifact,
            kind=kind,
            source=source,
            auto_complete=not self.settings.disable_auto_complete_config,
            default_max_batch_size=self.settings.default_max_batch_size,
        )
        config.platform = KIND_PLATFORMS[kind]
        config.backend = KIND_BACKENDS[kind]
        return ModelFile(config, artifact, kind, signature, bindings, options, declared)

    def prepare(self, entry: RepositoryEntry, version: str) -> PreparedVersion:
        """Read the version's model file (`read`), place the instances and order the runners of each."""
        model = self.read(entry, version)
        config, artifact, kind, options = model.config, model.artifact, model.kind, model.options
        bindings, signature, declared, source = model.bindings, model.signature, model.declared, entry.source
        devices = place_instances(config, self.settings.device, gpu_count(), source)
        strict = self.settings.strict_runner if options.strict is None else options.strict
        unbounded = unbounded_dimension(bindings, signature)
        chains = [
            choose_runner(kind, device, options, str(artifact), unbounded=unbounded, strict=strict)
            for device in devices
        ]
        report = RunnerReport(entry.name, config, [chain[0] for chain in chains])
        # Instances are made as they load, from the config as it is now (its sequence tensors included).
        complete = mc.ModelConfig()
        complete.CopyFrom(config)

        def build(choice: Choice) -> ArtifactInstance:
            return self._instance(entry.name, artifact, kind, choice, options, complete, bindings, signature)

        instances: list[Instance] = []
        for index, (device, chain) in enumerate(zip(devices, chains, strict=True)):
            asked = asked_for(options, device)
            if asked not in ("auto", chain[0].runner):  # what the config asks for cannot run here
                log.warning("%s: runner %s asked for; %s", entry.name, asked, chain[0].reason)
            else:
                log.info("%s: %s", entry.name, chain[0].reason)
            instances.append(
                FallbackInstance(
                    chain,
                    build,
                    on_loaded=functools.partial(report.loaded, index),
                    source=str(artifact),
                )
            )
        if config.HasField("sequence_batching"):
            del config.input[declared[0] :]
            del config.output[declared[1] :]
        report.show()
        log_ignored(config, ACTED_ON, source)
        return PreparedVersion(config=config, instances=instances)

    def _instance(
        self,
        model: str,
        artifact: Path,
        kind: str,
        choice: Choice,
        options: ModelOptions,
        config: mc.ModelConfig,
        bindings: Bindings,
        signature: Signature,
    ) -> ArtifactInstance:
        """The (unloaded) instance of one runner choice."""
        runner, device, reason = choice.runner, choice.device, choice.reason
        datatypes = {t.name: datatype_of_config(t.data_type) for t in config.input}
        datatypes.update({t.name: datatype_of_config(t.data_type) for t in config.output})
        common = dict(batching=config.max_batch_size > 0, device=device, reason=reason)
        threads = options.threads or self.settings.torch_threads
        if runner == "onnxruntime":
            return OnnxRuntimeInstance(artifact, bindings, datatypes, threads=threads, kind=kind, **common)
        if runner == "torch":
            return TorchInstance(
                artifact,
                bindings,
                datatypes,
                kind=kind,
                signature=signature,
                threads=threads,
                fp16=options.precision == "fp16",
                compile=options.torch_compile,
                **common,
            )
        return tensorrt.TensorRTInstance(
            artifact,
            bindings,
            datatypes,
            kind=kind,
            signature=signature,
            precision=options.precision,
            max_batch_size=config.max_batch_size,
            preferred_batch_size=max(config.dynamic_batching.preferred_batch_size, default=0),
            cache_dir=self.engine_cache,
            workspace_bytes=options.workspace_bytes,
            model=model,
            **common,
        )


def read_signature(path: Path, kind: str) -> Signature:
    """A model file's signature; `RepositoryError` naming the file when it cannot be read as its kind."""
    if kind == ONNX:
        return onnx_signature(path)
    if kind == TORCH_EXPORT:
        return export_signature(path)
    if kind == TORCHSCRIPT:
        return torchscript_signature(path)
    return tensorrt.plan_signature(path)


def unbounded_dimension(bindings: Bindings, signature: Signature) -> str:
    """The first input dimension, besides the batch, that varies without a bound the model file gives (a
    TensorRT profile needs one), as "input 'NAME' dimension N"; "" when there is none."""
    for binding in bindings.inputs:
        ranges = signature.ranges.get(binding.model_name, {})
        for axis, size in enumerate(binding.model_shape):
            if size == -1 and axis > 0 and not ranges.get(axis, (0, 0))[1]:
                return f"input '{binding.name}' dimension {axis}"
    return ""


def choose_runner(
    kind: str, device: str, options: ModelOptions, artifact: str, *, unbounded: str = "", strict: bool = False
) -> list[Choice]:
    """The runners that may run one instance of a model file placed on `device`, in the order they are tried,
    each with the device it runs on and why it is there: TensorRT, ONNX Runtime (the CUDA provider on a GPU),
    PyTorch on the GPU, then the CPU (ONNX Runtime or PyTorch, whichever runs the file). A pinned `runner`
    comes first. `strict` keeps the first alone (a failure to load it fails the model) and refuses a pinned
    runner that cannot run here; `RepositoryError` also for a pinned runner that cannot run the file.
    `unbounded` names an input dimension that varies without a bound: TensorRT cannot build an engine for it.
    """
    on_gpu = device.startswith("cuda")
    # An engine file runs at the precision it was built with; an engine built here, at the config's.
    at = "" if kind == TENSORRT_PLAN else f" at {options.precision}"
    own = "onnxruntime" if kind == ONNX else "torch" if kind in (TORCHSCRIPT, TORCH_EXPORT) else "tensorrt"
    # A PyTorch file runs on ONNX Runtime as its ONNX export when asked to.
    runs = (
        [own]
        if own != "torch"
        else ["onnxruntime", "torch"]
        if options.runner == "onnxruntime"
        else ["torch"]
    )
    pinned = asked_for(options, device)
    if pinned not in ("auto", own, "tensorrt") and not (pinned == "onnxruntime" and own == "torch"):
        raise RepositoryError(
            f"{artifact}: runner {pinned} cannot run a {KIND_PLATFORMS[kind]} file (it runs on {own}"
            f"{', onnxruntime' if own == 'torch' else ''} or tensorrt)"
        )
    choices: list[Choice] = []
    passed: list[str] = []  # why the runners ahead were passed over
    if kind == TENSORRT_PLAN or pinned == "tensorrt" or (on_gpu and pinned == "auto"):
        first = _tensorrt_first(kind, device, pinned, artifact, at=at, unbounded=unbounded, strict=strict)
        if isinstance(first, Choice):
            choices.append(first)
        else:
            passed.append(first)
    if kind == TENSORRT_PLAN:
        return choices
    start = pinned
    for place in (device, "cpu") if on_gpu else (device,):
        for runner in runs:
            if runner == "onnxruntime" and place != "cpu" and not _onnxruntime_has_cuda():
                passed.append("this ONNX Runtime has no CUDA provider")
                continue
            if choices:
                because = f"the fallback after {choices[-1].label}"
            elif passed:
                because = f"{start}: {', '.join(passed)}"
            else:
                because = f"{start}: " + ("the instance is on the CPU" if place == "cpu" else "asked for")
            choices.append(Choice(runner, place, f"{runner} on {place}: {because}"))
    return choices[:1] if strict else choices


def _tensorrt_first(
    kind: str, device: str, pinned: str, artifact: str, *, at: str, unbounded: str, strict: bool
) -> Choice | str:
    """TensorRT at the head of `choose_runner`'s list: its choice where it can run here, else why it is
    passed over; `RepositoryError` where nothing else may run the file (an engine file, or `strict` with
    TensorRT pinned or on the CPU)."""
    on_gpu = device.startswith("cuda")
    usable, why = tensorrt.tensorrt_status()
    if not on_gpu:
        usable, why = False, f"TensorRT runs on a GPU, and this instance is on {device}"
    elif usable and unbounded and kind != TENSORRT_PLAN:
        usable, why = False, f"{why}, but {unbounded} varies without a bound an engine profile needs"
    if usable:
        because = (
            "a TensorRT engine file" if kind == TENSORRT_PLAN else "asked for" if pinned != "auto" else "auto"
        )
        return Choice("tensorrt", device, f"tensorrt on {device}{at}: {because}; {why}")
    if kind == TENSORRT_PLAN or strict:
        what = "a TensorRT engine" if kind == TENSORRT_PLAN else "runner tensorrt"
        if not on_gpu:
            raise RepositoryError(
                f"{artifact}: {why} ({what}); use instance_group kind KIND_GPU"
                f"{'' if kind == TENSORRT_PLAN else ', or runner auto'}"
            )
        if kind == TENSORRT_PLAN or pinned == "tensorrt":
            raise RepositoryError(f"{artifact}: TensorRT was asked for but cannot run: {why}")
    return f"TensorRT is not usable ({why})"


def asked_for(options: ModelOptions, device: str) -> str:
    """The runner a config asks for on `device`: its `runner`, or tensorrt where it names a TensorRT
    accelerator and the instance is on a GPU; "auto" when it asks for none."""
    if options.runner == "auto" and options.tensorrt and device.startswith("cuda"):
        return "tensorrt"
    return options.runner


def _onnxruntime_has_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


class RunnerReport:
    """What runs each instance of one version, shown in its config: `instance_group` as the instances are
    placed, and the parameters `runner_in_use` and `runner_reason`. Rewritten as each instance loads (a
    fallback may have moved it), before the version serves; instances load on threads of their own."""

    def __init__(self, model: str, config: mc.ModelConfig, choices: list[Choice]) -> None:
        self.model = model
        self.config = config
        self.choices = list(choices)
        self._lock = threading.Lock()

    def loaded(self, index: int, choice: Choice) -> None:
        """Instance `index` loaded with `choice`."""
        with self._lock:
            self.choices[index] = choice
            self.show()

    def show(self) -> None:
        """Write the choices into the config."""
        del self.config.instance_group[:]
        self.config.instance_group.extend(placed_groups(self.model, [c.device for c in self.choices]))
        parameters = self.config.parameters
        parameters[RUNNER_KEY].string_value = ", ".join(dict.fromkeys(c.label for c in self.choices))
        parameters[REASON_KEY].string_value = "; ".join(dict.fromkeys(c.reason for c in self.choices))


def gpu_count() -> int:
    """CUDA GPUs visible to torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_instances(config: mc.ModelConfig, default_device: str, gpus: int, source: str) -> list[str]:
    """The device of every instance ("cpu", "cuda:N"), from Triton's `instance_group`.

    `KIND_GPU` places `count` instances on each GPU of `gpus`, or spreads them round robin over the visible
    GPUs when it names none; `KIND_CPU` places them on the CPU; `KIND_AUTO` and `KIND_MODEL` (and no
    `instance_group`) follow the service's `--device`: a GPU when one is visible, else the CPU.
    """
    groups = list(config.instance_group) or [
        mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    ]
    devices: list[str] = []
    turn = 0
    for group in groups:
        count = group.count or 1
        if count < 0:
            raise RepositoryError(f"{source}: instance_group count {group.count} is negative")
        kind = group.kind
        if kind in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_MODEL) and not group.gpus:
            if default_device == "cpu" or (default_device == "auto" and gpus == 0):
                kind = mc.ModelInstanceGroup.KIND_CPU
            elif default_device.startswith("cuda:"):
                if int(default_device[5:]) >= gpus:
                    raise RepositoryError(
                        f"{source}: --device {default_device}, but {gpus} GPU(s) are visible"
                    )
                devices += [default_device] * count
                continue
            else:
                kind = mc.ModelInstanceGroup.KIND_GPU
        elif kind in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_MODEL):
            kind = mc.ModelInstanceGroup.KIND_GPU
        if kind == mc.ModelInstanceGroup.KIND_CPU:
            if group.gpus:
                raise RepositoryError(
                    f"{source}: instance_group of kind KIND_CPU names gpus {list(group.gpus)}"
                )
            devices += ["cpu"] * count
            continue
        if gpus == 0:
            raise RepositoryError(
                f"{source}: instance_group asks for GPU instances, but no CUDA GPU is visible"
            )
        unknown = [g for g in group.gpus if not 0 <= g < gpus]
        if unknown:
            raise RepositoryError(
                f"{source}: instance_group names GPU(s) {unknown}, but {gpus} are visible (0..{gpus - 1})"
            )
        if group.gpus:
            for gpu in group.gpus:
                devices += [f"cuda:{gpu}"] * count
        else:
            for _ in range(count):
                devices.append(f"cuda:{turn % gpus}")
                turn += 1
    return devices


def placed_groups(model: str, devices: list[str]) -> list[mc.ModelInstanceGroup]:
    """The instances as placed, as `instance_group` entries: one per device, in order of first use."""
    counts: Mapping[str, int] = {d: devices.count(d) for d in dict.fromkeys(devices)}
    groups = []
    for index, (device, count) in enumerate(counts.items()):
        if device == "cpu":
            groups.append(
                mc.ModelInstanceGroup(
                    name=f"{model}_{index}", count=count, kind=mc.ModelInstanceGroup.KIND_CPU
                )
            )
        else:
            gpu = int(device.partition(":")[2] or 0)
            groups.append(
                mc.ModelInstanceGroup(
                    name=f"{model}_{index}", count=count, kind=mc.ModelInstanceGroup.KIND_GPU, gpus=[gpu]
                )
            )
    return groups
