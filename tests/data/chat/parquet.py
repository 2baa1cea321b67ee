"""Parquet files for tests/chat_data.rs, written by pyarrow as `datasets` writes them.

Usage (from the repository root; needs pyarrow):
    python tests/data/chat/parquet.py

- chat.parquet: a `messages` column (list of {role, content} structs), snappy, two row
  groups; chat.jsonl holds the same records as JSON lines;
- prompt.parquet: `prompt` and `completion` string columns, zstd; prompt.jsonl the same;
- bad.parquet: `messages` whose `content` is an integer column.
"""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Peru", "Lima"), ("Japan", "Tokyo")]


def write(name, rows, **options):
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(HERE, f"{name}.parquet"), **options)
    with open(os.path.join(HERE, f"{name}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    chats = []
    for i, (country, city) in enumerate(CAPITALS * 2):
        messages = [{"role": "user", "content": f"What is the capital of {country}?"}, {"role": "assistant", "content": city}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer in one word."})
        chats.append({"messages": messages})
    write("chat", chats, compression="snappy", row_group_size=4)
    prompts = [{"prompt": f"The capital of {c} is", "completion": f" {city}."} for c, city in CAPITALS]
    write("prompt", prompts, compression="zstd")
    bad = [{"messages": [{"role": "user", "content": 7}]}]
    pq.write_table(pa.Table.from_pylist(bad), os.path.join(HERE, "bad.parquet"))


if __name__ == "__main__":
    main()
