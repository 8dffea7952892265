"""`ModelConfig` of Triton's Python backend: what a `TritonPythonModel.auto_complete_config` gets and returns.

The model receives its config as Triton's JSON (`as_dict()`: field names, every field present) and may add
what its `config.pbtxt` leaves out: `max_batch_size`, inputs, outputs, the dynamic batcher and the
transaction policy. What it sets may complete the config, never contradict it: a datatype, dims or a larger
`max_batch_size` that disagree with what the config declares are refused, naming both. Those fields alone are
taken back (`pipeline.stage.triton_model`); anything else the model changes in the dict is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

#: The fields `auto_complete_config` may set, which the python backend takes back.
COMPLETED_FIELDS = ("max_batch_size", "input", "output", "dynamic_batching", "model_transaction_policy")


class ModelConfig:
    """A model's config for `auto_complete_config`, in Triton's JSON form."""

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        config.setdefault("max_batch_size", 0)
        config.setdefault("input", [])
        config.setdefault("output", [])
        self._config: dict[str, Any] = config

    def as_dict(self) -> dict[str, Any]:
        """The config as it stands (read it; change it through the setters)."""
        return self._config

    @property
    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set `max_batch_size`; refused when the config declares a larger one."""
        declared = int(self._config.get("max_batch_size", 0))
        if declared > max_batch_size:
            raise ValueError(
                f"model '{self._name}': its config declares max_batch_size {declared}, more than the "
                f"{max_batch_size} auto_complete_config sets"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        """Ask for the dynamic batcher (with its defaults) unless the config already does; refused when the
        config names another scheduler."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(
                    f"model '{self._name}': its config sets {other}, and auto_complete_config asks for "
                    "dynamic_batching"
                )
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        """Add an input (`name`, `data_type`, `dims`, optionally `optional`), or complete the config's input
        of that name; refused where they disagree."""
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add an output (`name`, `data_type`, `dims`), or complete the config's output of that name."""
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set the transaction policy (its one property: `decoupled`); refused where the config disagrees."""
        unknown = sorted(set(transaction_policy_dict) - {"decoupled"})
        if unknown:
            raise ValueError(
                f"model '{self._name}': the transaction policy has no {', '.join(unknown)} (only 'decoupled')"
            )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    f"model '{self._name}': its config sets decoupled {bool(policy['decoupled'])}, and "
                    f"auto_complete_config sets {wanted}"
                )
            policy["decoupled"] = wanted

    def _add(self, kind: str, tensor: Mapping[str, Any], allowed: Collection[str]) -> None:
        name = tensor.get("name")
        where = f"model '{self._name}', {kind} '{name}'"
        unknown = sorted(set(tensor) - set(allowed))
        if unknown:
            raise ValueError(
                f"{where}: auto_complete_config sets {', '.join(unknown)} (allowed: {', '.join(allowed)})"
            )
        missing = [key for key in ("name", "data_type", "dims") if key not in tensor]
        if missing:
            raise ValueError(f"{where}: auto_complete_config leaves out {', '.join(missing)}")
        for declared in self._config[kind]:
            if declared.get("name") != name:
                continue
            declared_type = declared.get("data_type") or "TYPE_INVALID"
            if declared_type != "TYPE_INVALID" and declared_type != tensor["data_type"]:
                raise ValueError(
                    f"{where}: the config declares {declared_type}, auto_complete_config {tensor['data_type']}"
                )
            if declared.get("dims") and list(declared["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"{where}: the config declares dims {list(declared['dims'])}, auto_complete_config "
                    f"{list(tensor['dims'])}"
                )
            if "optional" in tensor and declared.get("optional", tensor["optional"]) != tensor["optional"]:
                raise ValueError(
                    f"{where}: the config declares optional {declared['optional']}, auto_complete_config "
                    f"{tensor['optional']}"
                )
            declared.update({key: tensor[key] for key in allowed if key in tensor})
            return
        self._config[kind].append(dict(tensor))
