"""Datasets for SFT, reward-model training and rollouts: records from JSONL / Parquet / HF
`datasets` directories (records.py), bad-record policy (report.py), tokenizers (tokenizer.py),
prompt formats (templates.py), tokenizing with truncation (encode.py), seeded order and eval
hold-out (order.py), SFT rows and packing (packing.py), reward-model pair batches (pairs.py)
as prompt + response SequenceBatches (sequences.py, what rollouts and the roles use too),
all of it wired from a DataConfig (config.py, dataset.py), rollout prompt files
(prompts.py), image rows for vision-language models (images.py), and demo data made by code
(synthetic.py, embedded.py)."""
