"""Datasets as LLaMA-Factory users name them: dataset_info.json names (columns, tags, num_samples), several
datasets concatenated or interleaved, max_samples, a dataset in the local HF cache, the tokenized cache
(datasets.map) that a resume or a second rank reads back, LLaMA-Factory's template names; and rows that crashed
the data path before (alpaca history "x", a sharegpt turn that is a string, non-UTF-8 jsonl, a jsonl of
null lines), each now one line with nothing left in the system temp dir."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
import pytest
from checks import one_line

from lazytrain.data import sft as sft_module
from lazytrain.data.corpus import zen_of_python
from lazytrain.data.loader import IGNORE_INDEX
from lazytrain.data.sft import Tokenization, load_sft, tokenize_rows
from lazytrain.data.sources import check_names, resolve
from lazytrain.data.templates import names
from lazytrain.data.tokenizer import train_bpe_tokenizer
from lazytrain.errors import LazyTrainError

RNG = random.Random()
WORDS = "the cat sat on a mat and the dog ran to see what it was doing Hi there 12 7".split()


def _words(n: int) -> str:
    return " ".join(RNG.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizer_factory():
    texts = [zen_of_python(), " ".join(WORDS), "Human Assistant System INST model user 0123456789"]
    return lambda: train_bpe_tokenizer(texts, vocab_size=400)


def _lf_data(root: Path, n_alpaca: int = 6, n_sharegpt: int = 5) -> tuple[list[dict], list[dict]]:
    """A LLaMA-Factory data folder: an alpaca file with renamed columns and a sharegpt file with its own tags."""
    root.mkdir(parents=True, exist_ok=True)
    alpaca = [{"q": _words(3), "extra": _words(2) if i % 2 else "", "a": _words(4)} for i in range(n_alpaca)]
    sharegpt = [{"dialog": [{"speaker": "person", "text": _words(3)}, {"speaker": "bot", "text": _words(4)}]}
                for _ in range(n_sharegpt)]
    (root / "qa.json").write_text(json.dumps(alpaca))
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt))
    info = {
        "my_alpaca": {"file_name": "qa.json", "columns": {"prompt": "q", "query": "extra", "response": "a"}},
        "my_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                    "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "person",
                             "assistant_tag": "bot"}},
        "sampled": {"file_name": "qa.json", "columns": {"prompt": "q", "query": "extra", "response": "a"},
                    "num_samples": 9},
        "pairs": {"file_name": "qa.json", "ranking": True},
        "pictures": {"file_name": "qa.json", "formatting": "sharegpt", "columns": {"images": "images"}},
    }
    (root / "dataset_info.json").write_text(json.dumps(info))
    return alpaca, sharegpt


def test_dataset_info_names_read_with_their_columns_and_tags(tmp_path, tokenizer_factory):
    alpaca, sharegpt = _lf_data(tmp_path / "data")
    tok = tokenizer_factory()
    data = load_sft("my_alpaca,my_chat", tok, cutoff_len=256, dataset_dir=str(tmp_path / "data"))
    assert data.num_rows == len(alpaca) + len(sharegpt) and len(data.examples) == data.num_rows
    assert data.dataset_format == "alpaca+sharegpt" and data.template == "the tokenizer's own chat template"
    as_messages = [[{"role": "user", "content": "\n".join(p for p in (r["q"], r["extra"]) if p)},
                    {"role": "assistant", "content": r["a"]}] for r in alpaca]
    as_messages += [[{"role": "user", "content": r["dialog"][0]["text"]},
                     {"role": "assistant", "content": r["dialog"][1]["text"]}] for r in sharegpt]
    expected = tokenize_rows([{"messages": m} for m in as_messages], tok, cutoff_len=256).examples
    assert data.examples == expected  # the same conversations, in order (concat)
    # num_samples draws 9 of 6 rows (every row once, then 3 again), max_samples cuts each dataset
    assert load_sft("sampled", tok, cutoff_len=256, dataset_dir=str(tmp_path / "data")).num_rows == 9
    capped = load_sft("my_alpaca,my_chat", tok, cutoff_len=256, dataset_dir=str(tmp_path / "data"), max_samples=2)
    assert capped.num_rows == 4 and capped.examples == expected[:2] + expected[len(alpaca):len(alpaca) + 2]


def test_dataset_info_entries_lazytrain_does_not_train_on_are_refused(tmp_path):
    _lf_data(tmp_path / "data")
    for name, needle in (("pairs", "ranking (preference) data"), ("pictures", "its images columns"),
                         ("nope", "nor a name in")):
        with pytest.raises(LazyTrainError) as err:
            resolve((name,), str(tmp_path / "data"))
        one_line(str(err.value), needle)
    with pytest.raises(LazyTrainError, match=r"dataset_info.json does not exist \(set dataset_dir\)"):
        resolve(("identity",), str(tmp_path / "elsewhere"))
    with pytest.raises(LazyTrainError, match="math is a dataset of its own"):
        check_names("math,my_alpaca", None, str(tmp_path / "data"))
    # LLaMA-Factory's data folder given as the dataset (its dataset_info.json was taken for save_to_disk's)
    with pytest.raises(LazyTrainError) as err:
        check_names(str(tmp_path / "data"), None, "data")
    assert str(err.value) == (f"dataset {tmp_path / 'data'} is a LLaMA-Factory data folder (its dataset_info.json "
                              f"names datasets, e.g. my_alpaca, my_chat, pairs, pictures); set dataset_dir: "
                              f"{tmp_path / 'data'} and dataset to names in it")


@pytest.mark.parametrize("strategy", ["interleave_under", "interleave_over"])
def test_interleaving_follows_hf_datasets(tmp_path, tokenizer_factory, strategy):
    _lf_data(tmp_path / "data", n_alpaca=6, n_sharegpt=3)
    tok = tokenizer_factory()
    probs = [0.7, 0.3]
    data = load_sft("my_alpaca,my_chat", tok, cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                    mix_strategy=strategy, interleave_probs=probs, seed=5)
    one = [load_sft(name, tok, cutoff_len=256, dataset_dir=str(tmp_path / "data")).examples
           for name in ("my_alpaca", "my_chat")]
    reference = datasets.interleave_datasets(
        [datasets.Dataset.from_dict({"i": [(0, k) for k in range(6)]}),
         datasets.Dataset.from_dict({"i": [(1, k) for k in range(3)]})], probabilities=probs, seed=5,
        stopping_strategy="first_exhausted" if strategy == "interleave_under" else "all_exhausted")
    assert data.examples == [one[d][k] for d, k in reference["i"]]
    with pytest.raises(LazyTrainError, match="interleave_probs has 3 weights for 2 datasets"):
        load_sft("my_alpaca,my_chat", tok, cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                 mix_strategy=strategy, interleave_probs=[1, 1, 1])


def test_a_dataset_in_the_local_hf_cache_is_read_offline_and_a_missing_one_names_the_download(
        tmp_path, monkeypatch, tokenizer_factory):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    rows = [{"instruction": _words(3), "output": _words(3)} for _ in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files={"train": str(tmp_path / "train.jsonl")},
                                            cache_dir=str(tmp_path / "json-cache"))
    builder.dataset_name = "tiny-sft"  # what a download of someone/tiny-sft leaves in the cache
    builder.download_and_prepare(output_dir=str(tmp_path / "hf" / "someone___tiny-sft" / "default" / "0.0.0" / "ab"))
    tok = tokenizer_factory()
    data = load_sft("someone/tiny-sft", tok, cutoff_len=256, dataset_dir=str(tmp_path / "no-data"))
    assert data.examples == tokenize_rows(rows, tok, cutoff_len=256).examples
    assert os.environ.get("HF_DATASETS_OFFLINE") is None and not datasets.config.HF_DATASETS_OFFLINE  # restored
    with pytest.raises(LazyTrainError) as err:
        load_sft("someone/not-downloaded", tok, cutoff_len=256, dataset_dir=str(tmp_path / "no-data"))
    one_line(str(err.value), "is not in the local HF datasets cache")
    assert "datasets.load_dataset('someone/not-downloaded')" in str(err.value)


def test_tokens_are_cached_and_read_back_without_tokenizing(tmp_path, monkeypatch, tokenizer_factory):
    _lf_data(tmp_path / "data")
    calls = []
    real = sft_module.tokenize_batch
    monkeypatch.setattr(sft_module, "tokenize_batch", lambda batch, **kw: calls.append(1) or real(batch, **kw))
    how = Tokenization(cutoff_len=256, cache_dir=tmp_path / "cache", batch_size=4)
    first = load_sft("my_alpaca,my_chat", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                     how=how)
    assert calls and not first.cached
    calls.clear()
    again = load_sft("my_alpaca,my_chat", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                     how=how)
    assert again.cached and not calls and again.examples == first.examples  # a resume, a second rank
    # overwrite_cache tokenizes again; another cutoff_len or a changed file is another key
    forced = load_sft("my_alpaca", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                      how=Tokenization(cutoff_len=256, cache_dir=tmp_path / "cache", overwrite_cache=True))
    assert calls and not forced.cached
    calls.clear()
    os.utime(tmp_path / "data" / "qa.json", ns=(1, 1))
    assert not load_sft("my_alpaca", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                        how=how).cached
    # a folder a killed run left (its pid gone) is removed by the next run; a live one is not touched
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "cache" / f".abc.tmp-{dead.stdout.strip()}").mkdir()
    (tmp_path / "cache" / f".def.tmp-{os.getpid()}").mkdir()
    load_sft("my_alpaca", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"), how=how)
    assert [p.name for p in (tmp_path / "cache").glob(".*")] == [f".def.tmp-{os.getpid()}"]


def test_several_workers_tokenize_the_same_examples(tmp_path, tokenizer_factory):
    _lf_data(tmp_path / "data", n_alpaca=12, n_sharegpt=9)
    one = load_sft("my_alpaca,my_chat", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"))
    two = load_sft("my_alpaca,my_chat", tokenizer_factory(), cutoff_len=256, dataset_dir=str(tmp_path / "data"),
                   how=Tokenization(cutoff_len=256, cache_dir=tmp_path / "cache", num_proc=2, batch_size=5))
    assert two.examples == one.examples
    assert len(list((tmp_path / "cache").glob("*/tokens_*.arrow"))) == 2  # one file per worker


# ---- rows that crashed the data path ---------------------------------------------------------------------
@pytest.mark.parametrize("name, content, needle", [
    ("history.json", json.dumps([{"instruction": "a", "output": "b", "history": "x"}]),
     'row 1 (alpaca): history is "x", expected a list of [instruction, response] pairs'),
    ("pair.json", json.dumps([{"instruction": "a", "output": "b", "history": [["q", 3]]}]),
     "history[0] is [\"q\", 3], expected [instruction, response]"),
    ("turn.jsonl", json.dumps({"conversations": [{"from": "human", "value": "q"}, "gpt says hi"]}) + "\n",
     'row 1 (sharegpt): turn 2 is "gpt says hi", expected an object with from and value'),
    ("latin1.jsonl", '{"text": "caf\xe9"}\n', "line 1: not UTF-8 text"),
    ("nulls.jsonl", "null\nnull\n", "line 1: null is not a JSON object"),
    ("list.jsonl", "[1, 2]\n", "line 1: [1, 2] is not a JSON object"),
    ("number.json", "[{\"text\": \"a\"}, 5]", "row 2: 5 is not an object"),
    ("content.jsonl", json.dumps({"messages": [{"role": "user", "content": ["x"]}]}) + "\n",
     'a turn 1 content is ["x"], expected a string'),
    ("tool.jsonl", json.dumps({"conversations": [{"from": "observation", "value": "q"}]}) + "\n",
     "tool turn"),
])
def test_malformed_rows_are_one_line_and_leave_no_temp_folder(tmp_path, tokenizer_factory, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1" if name.startswith("latin1") else "utf-8"))
    before = set(Path(tempfile.gettempdir()).glob("lazytrain-datasets-*"))
    with pytest.raises(LazyTrainError) as err:
        load_sft(str(path), tokenizer_factory(), cutoff_len=64)
    one_line(str(err.value), needle)
    assert set(Path(tempfile.gettempdir()).glob("lazytrain-datasets-*")) == before


def test_a_null_jsonl_through_the_cli_is_exit_2_not_a_crash(tmp_path):
    """A jsonl of null lines killed the process with SIGSEGV inside pyarrow; now it never reaches pyarrow."""
    (tmp_path / "nulls.jsonl").write_text("null\n" * 50)
    model = tmp_path / "model"
    train_bpe_tokenizer([" ".join(WORDS)] * 3, vocab_size=300).save_pretrained(str(model))
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 16,
                                                   "intermediate_size": 32, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "num_key_value_heads": 1}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", f"model={model}",
                           f"dataset={tmp_path / 'nulls.jsonl'}", f"output_dir={tmp_path / 'run'}", "init=random",
                           "max_steps=1", "dtype=fp32", "progress=false"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == f"error: dataset file {tmp_path / 'nulls.jsonl'} line 1: null is not a JSON " \
                                  "object; each line must be one object of columns"


def test_a_dataset_path_that_is_no_file_nor_folder_is_refused_before_it_is_opened(tmp_path):
    """A FIFO (open() would wait for a writer forever), named directly, as a .txt corpus or by dataset_info.json,
    is refused in one line; through `lazytrain train` within seconds, exit 2."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "text.txt")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"piped": {"file_name": "rows.jsonl"}}))
    for dataset, dataset_dir in ((str(fifo), "data"), (str(tmp_path / "text.txt"), "data"), ("piped", str(tmp_path))):
        with pytest.raises(LazyTrainError) as err:
            check_names(dataset, None, dataset_dir)
        assert "is not a regular file or folder (a FIFO)" in str(err.value) and "\n" not in str(err.value)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    done = subprocess.run([sys.executable, "-m", "lazytrain", "train", f"dataset={fifo}", "model=debug",
                           f"output_dir={tmp_path / 'run'}", "progress=false"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "(a FIFO)" in done.stderr, done.stderr[-2000:]


def test_a_dataset_info_file_name_outside_dataset_dir_is_refused(tmp_path):
    """file_name is relative to dataset_dir and stays in it: `..` or an absolute path is refused, even when the
    file it names exists."""
    data = tmp_path / "a" / "data"
    data.mkdir(parents=True)
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "secret"}) + "\n")
    (data / "dataset_info.json").write_text(json.dumps({"up": {"file_name": "../../x.jsonl"},
                                                        "absolute": {"file_name": str(tmp_path / "x.jsonl")}}))
    for name in ("up", "absolute"):
        with pytest.raises(LazyTrainError) as err:
            resolve((name,), str(data))
        assert "outside" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_line_longer_than_the_bound_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    """A jsonl line is read with a bound (rows.MAX_LINE_BYTES, lowered here): a file with no line break is refused
    after reading the bound, not after holding the whole file (a 2 GiB one took 4.5 GiB)."""
    from lazytrain.data import rows

    monkeypatch.setattr(rows, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "one_line.jsonl"
    path.write_text(json.dumps({"text": _words(2000)}))  # ~8 KB, no line break
    with pytest.raises(LazyTrainError) as err:
        rows._path_rows(path, "train")
    assert "line 1 is longer than 1000 bytes" in str(err.value) and "\n" not in str(err.value), str(err.value)
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": _words(100)[:900]}) + "\n")
    assert len(rows._path_rows(path, "train")) == 2  # lines up to the bound are read


# ---- templates ---------------------------------------------------------------------------------------------
CONVERSATION = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello 12"}, {"role": "user", "content": "And 3+4?"},
                {"role": "assistant", "content": "7"}]


@pytest.mark.parametrize("name", sorted(set(names()) - {"empty", "fewshot"}))  # these two write no turn markers
def test_every_template_name_trains_exactly_the_assistant_turns(tokenizer_factory, name):
    tok = tokenizer_factory()
    tok.chat_template = None
    data = tokenize_rows([{"messages": CONVERSATION}], tok, template=name, cutoff_len=512)
    assert data.template == f"LLaMA-Factory's {name} template"
    [example] = data.examples
    trained = tok.decode([t for t, label in zip(example.input_ids, example.labels, strict=True)
                          if label != IGNORE_INDEX])
    assert "Hello 12" in trained and "7" in trained
    assert "Hi there" not in trained and "And 3+4?" not in trained and "Be brief" not in trained


def test_a_named_template_wins_over_the_tokenizers_own(tokenizer_factory):
    tok = tokenizer_factory()  # ChatML of its own, kept (LF installs llama3's only where there is none)
    own = tok.chat_template
    data = tokenize_rows([{"messages": CONVERSATION[1:3]}], tok, template="llama3", cutoff_len=512)
    assert data.template == "LLaMA-Factory's llama3 template" and tok.chat_template == own
    [example] = data.examples
    assert "<|start_header_id|>user<|end_header_id|>" in tok.decode(example.input_ids)
    with pytest.raises(LazyTrainError, match="template qwen2_vl is a vision / audio template"):
        tokenize_rows([{"messages": CONVERSATION[1:3]}], tok, template="qwen2_vl", cutoff_len=512)
