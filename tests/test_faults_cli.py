"""The command line as an adversarial user drives it: every bad input is one `error:` line naming its root cause,
exit 2, nothing written. (Loading faults: test_faults_loading.py; storage: test_faults_storage.py; the training
loop: test_faults.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checks import cli_error

from lazytrain.cli import main

TRAIN = ["train", "--batch-size", "2", "--seq-len", "16", "--steps", "1", "--eval-batches", "0", "--no-progress",
         "--device", "cpu"]


def _refused(capsys, argv: list[str], needle: str, *, not_needle: str | None = None, out: Path | None = None) -> str:
    assert main(argv) == 2
    err = cli_error(capsys, needle)
    assert not_needle is None or not_needle not in err, err
    assert out is None or not out.exists(), "the output directory was written"
    return err


# ---- check order: the cheapest, most basic check first ----------------------------------------------------
@pytest.mark.parametrize("key", ["dataset", "eval_dataset"])
def test_a_missing_dataset_file_is_named_before_the_model_tokenizer_mismatch(tmp_path, capsys, key):
    """A built-in shape (byte tokenizer) with a dataset file: the file's absence is the root cause, not the
    model/tokenizer mismatch a file that did exist would be refused for."""
    missing = tmp_path / "typo" / "train.jsonl"
    out = tmp_path / "run"
    words = [f"dataset={missing}"] if key == "dataset" else ["dataset=zen", f"eval_dataset={missing}"]
    _refused(capsys, [*TRAIN, "--model", "debug", *words, "--output-dir", str(out)],
             f"{key} {missing}: no such file", not_needle="built-in shape", out=out)


def test_a_model_dir_without_weights_is_named_before_the_host_memory_check(tmp_path, capsys):
    """A 70B-shaped config.json without weights on this machine: "no weights" (cheap, the root cause), not
    "needs 1 TiB of host memory" (what admission would say of weights that are not there)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096)))
    out = tmp_path / "run"
    _refused(capsys, [*TRAIN, "--model", str(model), "dataset=zen", "--output-dir", str(out)],
             "has no model.safetensors", not_needle="host memory", out=out)


# ---- sizes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("words, needle", [
    (["--gpu-mem-cap", "1e400"], "not a finite size"),
    (["gpu_mem_cap_bytes=2e308"], "not a finite size"),
    (["--seq-len", "99999999999"], "2..16777216"),
    (["--batch-size", "99999999999"], "1..16777216"),
])
def test_sizes_beyond_any_machine_are_one_line_in_plan_and_train(tmp_path, capsys, words, needle):
    """Before: a float overflow traceback (1e400 bytes), and `plan` printing a 34,320 TiB plan with exit 0."""
    _refused(capsys, ["plan", *words], needle)
    out = tmp_path / "run"
    _refused(capsys, [*TRAIN, "--model", "debug", "dataset=zen", *words, "--output-dir", str(out)], needle, out=out)


def test_a_calibration_step_beyond_host_memory_is_one_line(tmp_path, capsys, monkeypatch):
    """The emulated device's memory is the host's: the all-gpu calibration step is checked against the memory
    available before it is allocated (before: `DefaultCPUAllocator: can't allocate memory` and a traceback for
    --batch-size 4000000)."""
    from lazytrain.runtime import probe

    monkeypatch.setattr(probe, "available_host_memory_bytes", lambda: 1 << 10)
    out = tmp_path / "run"
    _refused(capsys, [*TRAIN, "--model", "debug", "dataset=zen", "--output-dir", str(out)],
             "calibration step", out=out)


# ---- dataset folders --------------------------------------------------------------------------------------
def test_a_dataset_dict_folder_loads_and_a_plain_folder_is_named_as_such(tmp_path):
    """`save_to_disk` of a DatasetDict writes dataset_dict.json, not dataset_info.json: it was refused as "does
    not exist"; a plain folder was too (it exists: the message now says what it lacks)."""
    import datasets

    from lazytrain.data.sft import load_rows
    from lazytrain.errors import LazyTrainError

    rows = [{"instruction": f"add {i} and {i + 1}", "output": str(2 * i + 1)} for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "dict")
    assert load_rows(tmp_path / "dict") == rows
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")
    assert load_rows(tmp_path / "one") == rows
    (tmp_path / "plain").mkdir()
    with pytest.raises(LazyTrainError, match="is a folder but not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "plain")


def test_an_nvme_dir_that_is_a_file_is_named_as_one(tmp_path, capsys):
    afile = tmp_path / "spill"
    afile.write_text("")
    out = tmp_path / "run"
    _refused(capsys, [*TRAIN, "--model", "debug", "dataset=zen", "--nvme-dir", str(afile), "--output-dir", str(out)],
             f"NVMe directory {afile} is not a directory", out=out)
