"""Training data: tokenizers, the embedded corpora, SFT formats and chat templates, the batch loader.

Modules (import the one you need; `sft` and `tokenizer` pull in `datasets` / `transformers`):
- `sources`: what a dataset name means (a file, a folder, dataset_info.json, the HF cache); `rows`: reading and
  checking its rows, each format turned into one canonical row.
- `corpus`: the 259-id byte tokenizer and the embedded text corpora (stdlib docstrings, the Zen of Python).
- `loader`: `Example`, `Batch`, `Loader` — fixed-shape batches, packing or padding, exact resume.
- `tokenizer`: a model directory's tokenizer (`load_tokenizer`), or a small byte-level BPE trained here.
- `templates`: named chat templates (chatml, llama3, alpaca) for tokenizers that have none.
- `sft`: local json/jsonl/parquet/arrow files in the alpaca, sharegpt, messages, prompt_completion or text
  format -> `Example`s with labels only on assistant turns (`load_sft`).
- `math`: the embedded MetaMathQA-like problem set and exact match of the final number.
- `default_job_files`: the small HF model directory and math data files of `lazytrain train` with no arguments.

"""
