"""A JSON document a user gives (a workload, a calibration, a model.json), read with one error line."""

import json


def load_json(path: str, what: str, build, label: str | None = None):
    """build(the JSON document at path); every failure a one-line ValueError starting with `label`
    (default: the path)."""
    label = label or path
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"{label}: cannot read {what}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{label}: not valid JSON: line {exc.lineno}: {exc.msg}") from None
    try:
        return build(data)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
