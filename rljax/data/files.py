"""Local prompt sets: JSONL and Parquet files read through a field mapping.

A mapping `{"prompt": "question", "answer": "solution.final"}` renames source fields
(dotted names reach into nested objects) to the fields rljax uses. Every record gets
`source` (`"path:line"` for JSONL, `"path:row"` for Parquet) so errors and metrics can
point at the file. Bad input names the file and line: a line that is not JSON, a line
that is not an object, a mapped field that is missing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

Mapping_ = Mapping[str, str]


def _validate_mapping(mapping: Mapping_ | None) -> dict[str, str] | None:
    if mapping is None:
        return None
    if not isinstance(mapping, Mapping) or not mapping or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in mapping.items()):
        raise ValueError(f"mapping must be a non-empty dict of target field -> source field "
                         f"names (strings), got {mapping!r}")
    return dict(mapping)


def _get(record: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = record
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def map_record(record: Any, mapping: Mapping_ | None, where: str) -> dict[str, Any]:
    """Apply `mapping` to one source record; `where` ("file:line") goes into errors and
    into the result's `source` field."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if mapping is None:
        out = dict(record)
    else:
        out = {}
        for target, src in mapping.items():
            try:
                out[target] = _get(record, src)
            except KeyError:
                raise ValueError(f"{where}: missing field {src!r} (mapped to {target!r}); "
                                 f"fields present: {sorted(record)}") from None
    out["source"] = where
    return out


def load_jsonl(path: str | os.PathLike, mapping: Mapping_ | None = None, *,
               transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None
               ) -> list[dict[str, Any]]:
    """Records of a JSONL file (blank lines skipped), mapped and optionally transformed.

    Raises ValueError naming `path:line` for a line that is not UTF-8 or not valid JSON,
    is not an object, or lacks a mapped field; FileNotFoundError if the file is missing.
    """
    mapping = _validate_mapping(mapping)
    path = os.fspath(path)
    out = []
    with open(path, "rb") as fh:
        for lineno, raw_line in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:  # name the line, not only the byte offset
                raise ValueError(f"{where}: not UTF-8 (byte {e.start}: {e.reason})") from None
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            rec = map_record(raw, mapping, where)
            out.append(transform(rec) if transform else rec)
    return out


def _unreadable_parquet(path: str, e: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:300]})")


def load_parquet(path: str | os.PathLike, mapping: Mapping_ | None = None, *,
                 transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """Records of a Parquet file (needs `pyarrow`), mapped like `load_jsonl`; a missing
    mapped column raises ValueError naming the file, the column and the columns present,
    and so does a file pyarrow cannot read (truncated, not Parquet, strings that are not
    UTF-8)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # optional dependency
        raise ImportError("load_parquet needs pyarrow: pip install pyarrow") from e
    mapping = _validate_mapping(mapping)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no Parquet file at {path}")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowIOError: name the file
        raise _unreadable_parquet(path, e) from None
    if mapping is not None:
        top = {src.split(".")[0] for src in mapping.values()}
        missing = sorted(top - set(table.column_names))
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing} named in mapping; "
                             f"columns present: {table.column_names}")
    try:  # the values are decoded here: a string column of invalid UTF-8 fails now
        rows = table.to_pylist()
    except (OSError, ValueError) as e:
        raise _unreadable_parquet(path, e) from None
    out = []
    for row, raw in enumerate(rows):
        rec = map_record(raw, mapping, f"{path}:row {row}")
        out.append(transform(rec) if transform else rec)
    return out


def load_prompts(path: str | os.PathLike, mapping: Mapping_ | None = None, **kw
                 ) -> list[dict[str, Any]]:
    """`load_jsonl` for .jsonl/.json lines files, `load_parquet` for .parquet."""
    p = os.fspath(path)
    if p.endswith((".jsonl", ".json", ".jsonl.txt")):
        return load_jsonl(p, mapping, **kw)
    if p.endswith(".parquet"):
        return load_parquet(p, mapping, **kw)
    raise ValueError(f"load_prompts: cannot tell the format of {p!r}; "
                     "allowed suffixes: .jsonl, .json, .parquet")


def gsm8k_transform(record: dict[str, Any], field: str = "answer") -> dict[str, Any]:
    """GSM8K keeps the worked solution and `#### 42` in one field: split it into
    `solution` (the whole text) and `answer` (the part after the last `####`)."""
    text = record[field]
    if not isinstance(text, str) or "####" not in text:
        raise ValueError(f"{record.get('source', '?')}: field {field!r} has no '#### answer'")
    out = dict(record)
    out["solution"] = text
    out["answer"] = text.rsplit("####", 1)[1].strip().replace(",", "")
    return out
