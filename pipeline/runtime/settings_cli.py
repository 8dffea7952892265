"""How a settings model becomes a command line: each field of a `ProcessSettings` model that carries an
`Option` is one flag, whose default is what the field's environment variable says, else the field's default.

So a value comes from its flag, else its variable, else the default, and argparse's `--help` (and the
reference pages `pipeline.docgen` writes from the parsers) show the defaults a process gets. The variables
are read by a pydantic-settings source (`ProcessSettings()`): an empty one counts as unset, and one that
does not parse is named in the error.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

G = TypeVar("G", bound=BaseModel)


class SettingError(ValueError):
    """An environment variable whose text does not parse; the message names it."""


@dataclass(frozen=True)
class Option:
    """A setting's flag(s), its environment variable and its help; `parse` reads the flag's and the
    variable's text (argparse's `type`). A setting without flags is read from its variable alone; one whose
    flag is a plain name (no leading `-`) is a positional argument. A field without a default is a flag the
    command line must give."""

    flags: tuple[str, ...]
    help: str
    env: str | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    #: argparse's action: "store_true", "store_false", "boolean" (`--flag` and `--no-flag`), or "append"
    #: (values given replace the default, not add to it).
    action: str | None = None
    nargs: str | None = None
    #: How the variable's text is read where it differs from one flag value's (a list: `parse` reads one item).
    env_parse: Callable[[str], Any] | None = None
    #: The values the flag takes, where it takes only some (argparse's `choices`).
    choices: tuple[str, ...] | None = None
    #: The flags of the same `exclusive` name are mutually exclusive: a command line gives one of them at most.
    exclusive: str | None = None


def option(*flags: str, help: str, **more: Any) -> Option:
    """`Option` with its flags as arguments, for `Annotated[type, option("--flag", help=...)]`."""
    return Option(tuple(flags), help, **more)


def option_of(field: FieldInfo) -> Option | None:
    """The `Option` of a model's field, if it has one."""
    return next((item for item in field.metadata if isinstance(item, Option)), None)


class _Environment(PydanticBaseSettingsSource):
    """The values the environment gives: each field's `Option.env`, parsed as its flag is; blank is unset."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _read(option_of(field))[1], field_name, False

    def __call__(self) -> dict[str, Any]:
        values = {}
        for name, field in self.settings_cls.model_fields.items():
            given, value = _read(option_of(field))
            if given:
                values[name] = value
        return values


def variable_text(variable: str, environ: Mapping[str, str] | None = None) -> str:
    """A variable's text (of `os.environ` by default), stripped: empty where it is unset or blank."""
    return (os.environ if environ is None else environ).get(variable, "").strip()


def read_variable(
    variable: str, parse: Callable[[str], Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[bool, Any]:
    """Whether a variable is set (to more than blanks), and then the value `parse` reads from its text;
    `SettingError` names a variable that does not parse."""
    text = variable_text(variable, environ)
    if not text:
        return False, None
    try:
        return True, text if parse is None else parse(text)
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise SettingError(f"{variable}={text!r}: {err}") from None


def _read(found: Option | None) -> tuple[bool, Any]:
    """Whether the option's variable is set, and its value then."""
    if found is None or found.env is None:
        return False, None
    return read_variable(found.env, found.env_parse or found.parse)


def variable_of(group: type[BaseModel], name: str) -> str:
    """The environment variable of a group's field."""
    found = option_of(group.model_fields[name])
    assert found is not None and found.env is not None, f"{group.__name__}.{name} has no variable"
    return found.env


def from_environment(
    group: type[BaseModel], name: str, environ: Mapping[str, str] | None = None
) -> tuple[bool, Any]:
    """Whether the environment (`os.environ` by default) sets the variable of a group's field, and the value
    it gives it then."""
    found = option_of(group.model_fields[name])
    if found is None or found.env is None:
        return False, None
    return read_variable(found.env, found.env_parse or found.parse, environ)


class ProcessSettings(BaseSettings):
    """Every setting of one process: the fields of its `groups`, in the order its flags are listed. Made
    (`RouterSettings()`, ...) from the environment, else the fields' defaults; a variable that does not parse
    raises `SettingError`, which names it."""

    model_config = SettingsConfigDict(frozen=True)
    #: The groups of settings the process takes, in the order `--help` lists them.
    groups: ClassVar[tuple[type[BaseModel], ...]] = ()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _Environment(settings_cls)

    @classmethod
    def parse(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> Self:
        """The process's settings from its command line, parsed once by `parser` (built by `add_arguments`);
        a value the model refuses stops with a usage error that names it."""
        try:
            return cls.of(parser.parse_args(argv))
        except SettingError as err:
            parser.error(str(err))

    @classmethod
    def of(cls, args: argparse.Namespace) -> Self:
        """The settings a parsed command line gives (each flag's default is already its variable's, else the
        field's); `SettingError` names a value the model refuses."""
        given = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        try:
            return cls(**given)
        except ValidationError as err:
            raise SettingError(_refused(cls, err)) from None

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's value where its flag is not given: its variable's, else its default (None for a field
        that the command line must give); `SettingError` names a variable that does not parse."""
        # The fields the command line must give have no default: a model of the others reads the environment.
        required: dict[str, Any] = {
            name: (Any, None) for name, field in cls.model_fields.items() if field.is_required()
        }
        model = create_model(cls.__name__, __base__=cls, **required) if required else cls
        return dict(model())

    def group(self, kind: type[G]) -> G:
        """This process's settings of one group, typed as that group (the process's model is a subclass of
        each of its groups): what a part of the server that needs only those settings is given."""
        if not isinstance(self, kind):
            raise TypeError(f"{type(self).__name__} has no {kind.__name__} settings")
        return self

    @classmethod
    def options(cls) -> Iterator[tuple[str, Option, FieldInfo]]:
        """(field name, its option, the field) of every field with a flag, group by group."""
        for name, found, field in cls.variables():
            if found.flags:
                yield name, found, field

    @classmethod
    def variables(cls) -> Iterator[tuple[str, Option, FieldInfo]]:
        """(field name, its option, the field) of every field with a flag or a variable (a setting that
        only a variable gives has no flag: a secret, or what no command line needs), group by group."""
        for group in cls.groups:
            for name in group.model_fields:
                field = cls.model_fields[name]
                found = option_of(field)
                if found is not None:
                    yield name, found, field


def _refused(settings: type[ProcessSettings], err: ValidationError) -> str:
    """What a model refused, by each setting's flag."""
    parts = []
    for error in err.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        field = settings.model_fields.get(name)
        found = option_of(field) if field is not None else None
        parts.append(f"{found.flags[0] if found is not None else name}: {error['msg']}")
    return "; ".join(parts)


def process_settings(name: str, groups: tuple[type[BaseModel], ...]) -> type[ProcessSettings]:
    """The settings model of one process: every field of `groups`, its flags listed in that order."""
    namespace = {"groups": groups, "__module__": groups[0].__module__}
    return type(name, (ProcessSettings, *reversed(groups)), namespace)


class _AppendOverDefault(argparse._AppendAction):
    """`append`, where the values given replace the default (the environment's list) instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


#: The actions of flags that take no value.
_SWITCHES = ("store_true", "store_false", "boolean")


def add_arguments(parser: argparse.ArgumentParser, settings: type[ProcessSettings]) -> None:
    """A flag for each of the settings' options, its default the environment's value, else the field's; a
    variable that does not parse stops with a usage error that names it."""
    try:
        defaults = settings.defaults()
    except SettingError as err:
        parser.error(str(err))
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for name, found, field in settings.options():
        arguments: dict[str, Any] = {"default": defaults[name], "help": found.help}
        if found.flags[0].startswith("-"):
            arguments.update(dest=name, required=field.is_required())
        if found.action == "append":
            arguments["action"] = _AppendOverDefault
        elif found.action == "boolean":
            arguments["action"] = argparse.BooleanOptionalAction
        elif found.action is not None:
            arguments["action"] = found.action
        if found.action not in _SWITCHES:
            arguments.update(
                type=found.parse, metavar=found.metavar, nargs=found.nargs, choices=found.choices
            )
        target: argparse._ActionsContainer = parser
        if found.exclusive is not None:
            if found.exclusive not in exclusive:
                exclusive[found.exclusive] = parser.add_mutually_exclusive_group()
            target = exclusive[found.exclusive]
        target.add_argument(*found.flags, **arguments)
