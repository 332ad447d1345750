"""Datasets: files (JSONL, Parquet, CSV, `datasets` folders, GSM8K) and generators."""
