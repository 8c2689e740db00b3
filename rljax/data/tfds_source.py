"""TFDS prompt sets as `array_record` files, prepared and read without TensorFlow.

TensorFlow Datasets writes and reads `array_record` files with no TensorFlow installed;
`builder.as_data_source(split)` / `tfds.data_source(...)` then give random access
(`len`, `[i]`), which is what the deterministic shuffled iterator needs. (`as_dataset()`
and tfrecord files do need TensorFlow; rljax never uses them.)

- `prepare_tfds_prompts` turns local JSONL files (e.g. GSM8K's train/test JSONL) into a
  TFDS dataset of text fields under `data_dir/rljax_prompts/<name>/1.0.0`.
- `TfdsPromptSource` reads any prepared TFDS dataset, by builder directory or by
  registered name, decodes bytes to str and applies a field mapping.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping, Sequence

from rljax.data.files import validate_mapping, load_jsonl, map_record


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:  # optional extra
        raise ImportError("the TFDS path needs `pip install rljax[tfds]` "
                          "(tensorflow-datasets and array-record; TensorFlow is not needed)") from e
    return tfds


@functools.cache
def _builder_class():
    """The GeneratorBasedBuilder, defined on first use so importing rljax.data does not
    import tensorflow_datasets."""
    tfds = _tfds()

    @dataclasses.dataclass
    class PromptsConfig(tfds.core.BuilderConfig):
        split_files: tuple = ()
        fields: tuple = ()
        mapping: tuple = ()

    class RljaxPrompts(tfds.core.GeneratorBasedBuilder):
        """Text prompt sets from local JSONL files, one config per dataset name."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            feats = {f: tfds.features.Text() for f in self.builder_config.fields}
            return tfds.core.DatasetInfo(builder=self,
                                         features=tfds.features.FeaturesDict(feats),
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(p) for s, p in self.builder_config.split_files}

        def _generate_examples(self, path):
            mapping = dict(self.builder_config.mapping) or None
            for i, rec in enumerate(load_jsonl(path, mapping)):
                row = {}
                for f in self.builder_config.fields:
                    if f not in rec or not isinstance(rec[f], str):
                        raise ValueError(f"{rec['source']}: field {f!r} must be a string, got "
                                         f"{type(rec.get(f)).__name__}")
                    row[f] = rec[f]
                yield i, row

    return PromptsConfig, RljaxPrompts


def prepare_tfds_prompts(split_files: Mapping[str, str | os.PathLike], *, name: str,
                         data_dir: str | os.PathLike, fields: Sequence[str],
                         mapping: Mapping[str, str] | None = None) -> str:
    """Write JSONL splits as a TFDS `array_record` dataset; returns the builder directory.

    Args:
      split_files: split name -> JSONL path, e.g. {"train": ".../train.jsonl"}.
      name: dataset (config) name, e.g. "gsm8k".
      fields: the (mapped) string fields to store, e.g. ("question", "answer").
      mapping: optional field mapping applied to each JSONL record first.
    Preparing an existing dataset again reuses it (TFDS semantics).
    """
    if not split_files or not all(isinstance(s, str) for s in split_files):
        raise ValueError(f"split_files must map split names to JSONL paths, got {split_files!r}")
    if not fields or isinstance(fields, str):
        raise ValueError(f"fields must be a non-empty sequence of field names, got {fields!r}")
    for s, p in split_files.items():
        if not os.path.isfile(p):
            raise FileNotFoundError(f"split {s!r}: no such file {os.fspath(p)!r}")
    validate_mapping(mapping)
    config_cls, builder_cls = _builder_class()
    cfg = config_cls(name=name, split_files=tuple((s, os.fspath(p)) for s, p in
                                                  split_files.items()),
                     fields=tuple(fields), mapping=tuple((mapping or {}).items()))
    builder = builder_cls(config=cfg, data_dir=os.fspath(data_dir), file_format="array_record")
    builder.download_and_prepare()
    return os.fspath(builder.data_dir)


class TfdsPromptSource:
    """Random-access prompt records from a prepared TFDS `array_record` dataset.

    Give `builder_dir` (what `prepare_tfds_prompts` returns, or any prepared dataset's
    version directory) or a registered dataset `name` with `data_dir`. Bytes are decoded
    to str, then `mapping` is applied; each record gets `source` = "tfds:name/split[i]".
    """

    def __init__(self, *, split: str, builder_dir: str | None = None, name: str | None = None,
                 data_dir: str | None = None, mapping: Mapping[str, str] | None = None):
        if (builder_dir is None) == (name is None):
            raise ValueError("TfdsPromptSource: give exactly one of builder_dir or name")
        tfds = _tfds()
        self.mapping = validate_mapping(mapping)
        if builder_dir is not None:
            builder = tfds.builder_from_directory(os.fspath(builder_dir))
            self._src = builder.as_data_source(split=split)
            self.name = builder.info.full_name
        else:
            self._src = tfds.data_source(name, split=split, data_dir=data_dir)
            self.name = name
        self.split = split

    def __len__(self) -> int:
        return len(self._src)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not isinstance(i, int) or not -len(self) <= i < len(self):
            raise IndexError(f"TfdsPromptSource: index {i!r} out of range for {len(self)} records")
        raw = {k: (v.decode("utf-8") if isinstance(v, bytes) else v)
               for k, v in self._src[i % len(self)].items()}
        return map_record(raw, self.mapping, f"tfds:{self.name}/{self.split}[{i % len(self)}]")
