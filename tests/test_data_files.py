"""Local prompt files (JSONL, Parquet) and TFDS array_record datasets without TensorFlow."""

import json
import sys

import pytest

from rljax import data as D

GSM = [{"question": f"Q{i}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
        "meta": {"level": i % 3}} for i in range(6)]


def write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_mapping_nested_and_transform(tmp_path):
    p = write_jsonl(tmp_path / "train.jsonl", GSM)
    recs = D.load_jsonl(p, {"prompt": "question", "answer": "answer", "level": "meta.level"},
                        transform=D.gsm8k_transform)
    assert len(recs) == 6
    assert recs[3]["prompt"] == GSM[3]["question"] and recs[3]["level"] == 0
    assert recs[3]["answer"] == "6" and recs[3]["solution"].endswith("#### 6")
    assert recs[3]["source"] == f"{p}:4"
    assert D.load_prompts(p)[0]["question"] == GSM[0]["question"]  # no mapping: as is


def test_jsonl_bad_lines_name_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", GSM[:2], ["{not json"])
    with pytest.raises(ValueError, match=rf"{p}:3: not valid JSON"):
        D.load_jsonl(p)
    p = write_jsonl(tmp_path / "cut.jsonl", GSM[:1], ['{"q": "2+2", "x": '])  # cut short
    with pytest.raises(ValueError, match=rf"{p}:2: not valid JSON \(Expecting value at "
                       r"column 19\)"):  # the line's own end, not column 1 of a next line
        D.load_jsonl(p)
    p = write_jsonl(tmp_path / "missing.jsonl", GSM[:2] + [{"question": "q"}])
    with pytest.raises(ValueError, match=rf"{p}:3: missing field 'answer' \(mapped to "
                       r"'target'\); fields present: \['question'\]"):
        D.load_jsonl(p, {"prompt": "question", "target": "answer"})
    p = write_jsonl(tmp_path / "list.jsonl", [], ["[1, 2]"])
    with pytest.raises(ValueError, match=rf"{p}:1: expected a JSON object, got list"):
        D.load_jsonl(p)
    with pytest.raises(ValueError, match="mapping must be a non-empty dict"):
        D.load_jsonl(p, {"prompt": 3})
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        D.load_prompts(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match=r"no prompt file at .*y\.csv \(the folder"):
        D.load_prompts(tmp_path / "y.csv")  # missing: said so, not "cannot tell the format"
    with pytest.raises(FileNotFoundError, match="no JSONL file at .*nope.jsonl"):
        D.load_jsonl(tmp_path / "nope.jsonl")


def test_empty_files_folders_bom_and_extra_fields(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl: no records \(the file is empty\)"):
        D.load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"no records \(its 2 lines are blank\)"):
        D.load_jsonl(tmp_path / "blank.jsonl")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        D.load_jsonl(tmp_path / "d.jsonl")
    p = tmp_path / "bom.jsonl"  # as Windows editors save UTF-8: a byte-order mark first
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GSM[0]) + "\n").encode())
    rec, = D.load_jsonl(p, {"prompt": "question", "ref": "final"}, optional=("ref",))
    # Every source field is kept beside the mapped ones; a missing optional one is absent.
    assert rec["prompt"] == rec["question"] == GSM[0]["question"] and "ref" not in rec
    assert rec["meta"] == {"level": 0} and rec["answer"] == GSM[0]["answer"]
    with pytest.raises(ValueError, match="missing field 'final'"):
        D.load_jsonl(p, {"prompt": "question", "ref": "final"})
    for encoding, name in (("utf-16", "UTF-16-LE"), ("utf-16-be", None), ("utf-32", "UTF-32-LE")):
        text = json.dumps(GSM[0]) + "\n"
        p.write_bytes(text.encode(encoding) if name else b"\xfe\xff" + text.encode(encoding))
        with pytest.raises(ValueError, match=f"bom.jsonl: the file is {name or 'UTF-16-BE'} "
                                             "\\(it starts with that byte-order mark\\)"):
            D.load_jsonl(p)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM), p)
    recs = D.load_prompts(p, {"prompt": "question", "answer": "answer", "lvl": "meta.level"})
    assert [r["prompt"] for r in recs] == [g["question"] for g in GSM]
    assert recs[4]["lvl"] == 1 and recs[4]["source"] == f"{p}:row 4"
    with pytest.raises(ValueError, match=rf"{p}: missing column\(s\) \['problem'\]"):
        D.load_parquet(p, {"prompt": "problem"})


def test_tfds_array_record_without_tensorflow(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    train = write_jsonl(tmp_path / "train.jsonl", GSM)
    test = write_jsonl(tmp_path / "test.jsonl", GSM[:2])
    bdir = D.prepare_tfds_prompts({"train": train, "test": test}, name="gsm8k_local",
                                  data_dir=tmp_path / "tfds", fields=("question", "answer"))
    files = sorted(p.name for p in (tmp_path / "tfds").rglob("*array_record*"))
    assert files and all("array_record" in f for f in files)
    src = D.TfdsPromptSource(split="train", builder_dir=bdir,
                             mapping={"prompt": "question", "answer": "answer"})
    assert len(src) == 6
    assert [src[i]["prompt"] for i in range(6)] == [g["question"] for g in GSM]
    assert src[-1]["answer"] == GSM[-1]["answer"] and isinstance(src[0]["prompt"], str)
    assert len(D.TfdsPromptSource(split="test", builder_dir=bdir)) == 2
    by_name = D.TfdsPromptSource(split="test", name="rljax_prompts/gsm8k_local",
                                 data_dir=str(tmp_path / "tfds"))
    assert [by_name[i]["question"] for i in range(2)] == [g["question"] for g in GSM[:2]]
    # random access feeds the resumable iterator directly
    it = D.ShuffledIterator(src, seed=0)
    assert sorted(r["prompt"] for r in it.next_batch(6)) == sorted(g["question"] for g in GSM)
    assert "tensorflow" not in sys.modules
    with pytest.raises(IndexError):
        src[6]
    with pytest.raises(ValueError, match="exactly one of"):
        D.TfdsPromptSource(split="train")
    with pytest.raises(FileNotFoundError, match="split 'dev'"):
        D.prepare_tfds_prompts({"dev": tmp_path / "none.jsonl"}, name="x",
                               data_dir=tmp_path, fields=("q",))
