"""Reading a YAML file of settings (a job file, a sweep file): one ``ConfigError`` naming the
file's setting for a missing file, bad syntax, a key given twice, or no mapping at the top."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

__all__ = ["load_mapping"]


class _Twice(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


def _strict_loader() -> Any:
    """A safe loader that refuses a key given twice in one mapping (PyYAML keeps the last
    silently: ``max_steps: 4`` then ``max_steps: 6`` ran 6 steps without a word)."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` may repeat
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _Twice(key, seen[key] + 1, key_node.start_mark.line + 1)
                seen[key] = key_node.start_mark.line
            except TypeError:  # an unhashable key: the constructor's own error follows
                pass
        return loader.construct_mapping(node, deep=deep)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Strict


def load_mapping(path: str, what: str, see: str) -> dict[str, Any]:
    """The mapping a YAML file holds; ``ConfigError(what, ...)`` when it is missing, is not
    valid YAML, gives a key twice, or holds no mapping (``see``: where its format is told)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_strict_loader())  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(what, f"{path} does not exist.", "check the path") from None
    except _Twice as e:
        raise ConfigError(what, f"{path} gives {e.key!r} twice (lines {e.first} and {e.second}),"
                          " and YAML would keep the last without a word.",
                          "give it once") from None
    except yaml.YAMLError as e:
        raise ConfigError(what, f"{path} is not valid YAML: {e}", "fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(what, f"{path} must hold a mapping of settings.", see)
    return data
