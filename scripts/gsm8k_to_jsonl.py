"""Convert GSM8K (Hugging Face `openai/gsm8k`, config "main") to nanoareal's JSONL format.

    pip install datasets && python scripts/gsm8k_to_jsonl.py --out data/

writes data/gsm8k_train.jsonl and data/gsm8k_test.jsonl with rows {"prompt": ..., "answer": "####
72"}; the `gsm8k` reward compares the completion's final number (or its '#### x') with that
answer. Needs the network once; nanoareal itself never downloads anything.
"""

import argparse
import json
from pathlib import Path

INSTRUCTION = ("Solve the problem step by step. Put the final answer on the last line as "
               "'#### <number>'.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data")
    args = p.parse_args()
    from datasets import load_dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = load_dataset("openai/gsm8k", "main", split=split)
        with open(out / f"gsm8k_{split}.jsonl", "w") as f:
            for r in rows:
                final = r["answer"].split("####")[-1].strip()
                f.write(json.dumps({"prompt": f"{r['question']}\n\n{INSTRUCTION}",
                                    "answer": f"#### {final}"}) + "\n")
        print(f"wrote {len(rows)} rows to {out / f'gsm8k_{split}.jsonl'}")


if __name__ == "__main__":
    main()
