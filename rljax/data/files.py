"""Local prompt sets: JSONL and Parquet files read through a field mapping.

A mapping `{"prompt": "question", "answer": "solution.final"}` adds the fields rljax uses
under their names, read from the source fields (dotted names reach into nested objects);
every field of the source record is kept too, so a reward's metadata and a prompt
template see all of them. Every record gets `source` (`"path:line"` for JSONL,
`"path:row N"` for Parquet) so errors and metrics can point at the file. Bad input names
the file and line: a line that is not JSON, a line that is not an object, a mapped field
that is missing (unless it is `optional`). A missing file, a folder where a file is
expected and a file with no records are errors that say so; a UTF-8 byte-order mark at
the start of a JSONL file is skipped (RFC 8259 §8.1 lets a parser ignore it), and a
UTF-16 or UTF-32 one (a Windows editor's "Unicode" save) is an error naming the encoding.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Sequence

Mapping_ = Mapping[str, str]


def validate_mapping(mapping: Mapping_ | None) -> dict[str, str] | None:
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


def map_record(record: Any, mapping: Mapping_ | None, where: str, *,
               optional: Sequence[str] = ()) -> dict[str, Any]:
    """The record's fields plus `mapping`'s targets read from their source fields; `where`
    ("file:line") goes into errors and into the result's `source` field. A target in
    `optional` whose source field is missing is left out; any other is an error."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    out = dict(record)
    for target, src in (mapping or {}).items():
        try:
            out[target] = _get(record, src)
        except KeyError:
            if target in optional:
                continue
            raise ValueError(f"{where}: missing field {src!r} (mapped to {target!r}); "
                             f"fields present: {sorted(record)}") from None
    out["source"] = where
    return out


def _existing_file(path: str, kind: str) -> None:
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder, not a {kind} file")
    if not os.path.exists(path):
        folder = os.path.dirname(path) or "."
        there = sorted(os.listdir(folder))[:20] if os.path.isdir(folder) else None
        raise FileNotFoundError(f"no {kind} file at {path}" + (
            f" (the folder {folder} holds {there})" if there is not None
            else f" (the folder {folder} does not exist either)"))


# Byte-order marks of encodings JSON files may not use (RFC 8259 §8.1: UTF-8 only);
# UTF-32's come first: UTF-32-LE's starts with UTF-16-LE's.
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32-LE"), (b"\x00\x00\xfe\xff", "UTF-32-BE"),
               (b"\xff\xfe", "UTF-16-LE"), (b"\xfe\xff", "UTF-16-BE"))


def _check_bom(first_line: bytes, path: str) -> bytes:
    """The first line without a UTF-8 byte-order mark; a UTF-16 / UTF-32 one is an error."""
    if first_line.startswith(b"\xef\xbb\xbf"):
        return first_line[3:]
    for bom, name in _OTHER_BOMS:
        if first_line.startswith(bom):
            raise ValueError(f"{path}: the file is {name} (it starts with that byte-order "
                             "mark); JSONL must be UTF-8: save it as UTF-8")
    return first_line


def load_jsonl(path: str | os.PathLike, mapping: Mapping_ | None = None, *,
               transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
               optional: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Records of a JSONL file (blank lines skipped), mapped and optionally transformed.

    Raises ValueError naming `path:line` for a line that is not UTF-8 or not valid JSON,
    is not an object, or lacks a mapped field not in `optional`, and for a file with no
    records; FileNotFoundError if the file is missing.
    """
    mapping = validate_mapping(mapping)
    path = os.fspath(path)
    _existing_file(path, "JSONL")
    out, lineno = [], 0
    with open(path, "rb") as fh:
        for lineno, raw_line in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            if lineno == 1:
                raw_line = _check_bom(raw_line, path)
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:  # name the line, not only the byte offset
                raise ValueError(f"{where}: not UTF-8 (byte {e.start}: {e.reason})") from None
            if not line.strip():
                continue
            try:  # without its line break: a line cut short fails at its own end, and the
                raw = json.loads(line.rstrip("\r\n"))  # column counts within the line
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            rec = map_record(raw, mapping, where, optional=optional)
            out.append(transform(rec) if transform else rec)
    if not out:
        what = "the file is empty" if lineno == 0 else f"its {lineno} lines are blank"
        raise ValueError(f"{path}: no records ({what})")
    return out


def _unreadable_parquet(path: str, e: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:300]})")


def load_parquet(path: str | os.PathLike, mapping: Mapping_ | None = None, *,
                 transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 optional: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Records of a Parquet file (needs `pyarrow`), mapped like `load_jsonl`; a missing
    mapped column raises ValueError naming the file, the column and the columns present,
    and so does a file pyarrow cannot read (truncated, not Parquet, strings that are not
    UTF-8)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # optional dependency
        raise ImportError("load_parquet needs pyarrow: pip install pyarrow") from e
    mapping = validate_mapping(mapping)
    path = os.fspath(path)
    _existing_file(path, "Parquet")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowIOError: name the file
        raise _unreadable_parquet(path, e) from None
    if mapping is not None:
        top = {src.split(".")[0] for t, src in mapping.items() if t not in optional}
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
        rec = map_record(raw, mapping, f"{path}:row {row}", optional=optional)
        out.append(transform(rec) if transform else rec)
    if not out:
        raise ValueError(f"{path}: no records (the table has no rows)")
    return out


def load_prompts(path: str | os.PathLike, mapping: Mapping_ | None = None, **kw
                 ) -> list[dict[str, Any]]:
    """`load_jsonl` for .jsonl/.json lines files, `load_parquet` for .parquet."""
    p = os.fspath(path)
    if p.endswith(PROMPT_SUFFIXES[:3]):
        return load_jsonl(p, mapping, **kw)
    if p.endswith(".parquet"):
        return load_parquet(p, mapping, **kw)
    _existing_file(p, "prompt")  # a missing path says so before its suffix is judged
    raise ValueError(f"load_prompts: cannot tell the format of {p!r}; "
                     f"allowed suffixes: {', '.join(PROMPT_SUFFIXES)}")


#: The file suffixes `load_prompts` reads (JSON lines, then Parquet).
PROMPT_SUFFIXES = (".jsonl", ".json", ".jsonl.txt", ".parquet")


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
