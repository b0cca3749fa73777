"""Convert GSM8K to nanoareal's JSONL format, from the hub (`openai/gsm8k`, config "main") or from
the files of github.com/openai/grade-school-math on disk.

    pip install datasets && python scripts/gsm8k_to_jsonl.py --out data/
    python scripts/gsm8k_to_jsonl.py --from-dir grade-school-math/grade_school_math/data --out data/

writes data/gsm8k_train.jsonl (7473 rows) and data/gsm8k_test.jsonl (1319) with rows {"prompt": the
question and an instruction, "answer": "#### 72"}; the `gsm8k` and `math` rewards compare the
completion's final answer with it. Only the hub needs the network. The published files also train
as they are: --dataset train.jsonl --prompt-key question --reward gsm8k.
"""

import argparse
import json
import sys
from pathlib import Path

INSTRUCTION = ("Solve the problem step by step. Put the final answer on the last line as "
               "'#### <number>'.")


def read_dir(data_dir: Path, split: str) -> list[dict]:
    """A split's rows from grade_school_math/data/<split>.jsonl, each checked."""
    path = data_dir / f"{split}.jsonl"
    if not path.is_file():
        sys.exit(f"--from-dir {data_dir}: no {split}.jsonl there (grade_school_math/data holds "
                 "train.jsonl and test.jsonl)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and "####" in str(row.get("answer"))):
                sys.exit(f'{path}:{n}: expected {{"question": ..., "answer": "... #### <number>"}}')
            rows.append(row)
    return rows


def convert(row: dict) -> dict:
    final = row["answer"].split("####")[-1].strip()
    return {"prompt": f"{row['question']}\n\n{INSTRUCTION}", "answer": f"#### {final}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data", help="directory for gsm8k_{train,test}.jsonl")
    p.add_argument("--from-dir", type=Path, help="grade_school_math/data of openai/grade-school-"
                   "math (train.jsonl, test.jsonl) instead of the hub")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if args.from_dir:
            rows = read_dir(args.from_dir, split)
        else:
            from datasets import load_dataset

            rows = load_dataset("openai/gsm8k", "main", split=split)
        with open(out / f"gsm8k_{split}.jsonl", "w") as f:
            f.writelines(json.dumps(convert(r)) + "\n" for r in rows)
        print(f"wrote {len(rows)} rows to {out / f'gsm8k_{split}.jsonl'}")


if __name__ == "__main__":
    main()
