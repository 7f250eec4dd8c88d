"""Run every example config of an Axolotl checkout through ``offloadkit train``'s config
loader and preflight, with only the model and dataset paths made local, and print the tally:
accepted, refused with one line naming a feature offloadkit does not have, and failing.

    python scripts/axolotl_examples.py /path/to/axolotl            # the tally
    python scripts/axolotl_examples.py /path/to/axolotl --train 20  # and one step of 20 accepted ones

Paths made local: ``base_model`` (and ``tokenizer_config``) become one built-in-size stand-in
(the tiny Llama with the byte tokenizer, which has a ChatML template), and each dataset
``path`` a small local file in the format its ``type`` reads. Nothing else is changed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import tempfile
import warnings

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from offloadkit.config import ConfigError, ConfigProblemsError  # noqa: E402


def stand_in_model(folder: str) -> str:
    """The tiny Llama and the byte tokenizer, saved where a ``base_model`` path would point."""
    from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer
    from offloadkit.models.zoo import build_llama

    path = os.path.join(folder, "model")
    if not os.path.isdir(path):
        build_llama("tiny", vocab_size=BYTE_VOCAB_SIZE).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


def _records(entry: dict) -> list:
    kind = str(entry.get("type", "completion"))
    if kind.startswith("alpaca"):
        return [
            {"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 2 else "numbers", "output": f"{2 * i + 1}"}
            for i in range(64)
        ]
    if kind.startswith("chat_template"):
        mappings = entry.get("message_property_mappings") or {}
        role_key = mappings.get("role", entry.get("message_field_role", "role"))
        content_key = mappings.get("content", entry.get("message_field_content", "content"))
        roles = entry.get("roles") or {}

        def name(role):
            aliases = roles.get(role)
            return (aliases if isinstance(aliases, str) else aliases[0]) if aliases else role

        field = entry.get("field_messages", "messages")
        return [
            {
                field: [
                    {role_key: name("user"), content_key: f"What is {i} plus {i}?"},
                    {role_key: name("assistant"), content_key: f"{2 * i}."},
                ]
            }
            for i in range(64)
        ]
    field = entry.get("field", "text")
    return [{field: "First Citizen: Before we proceed any further, hear me speak. " * 4} for _ in range(64)]


def localise(config: dict, folder: str, index: int) -> dict:
    """The config with its model and dataset paths replaced by local stand-ins."""
    config = dict(config)
    model = stand_in_model(folder)
    config["base_model"] = model
    if config.get("tokenizer_config"):
        config["tokenizer_config"] = model
    config["output_dir"] = os.path.join(folder, f"out-{index}")
    entries = config.get("datasets")
    if isinstance(entries, list):
        local = []
        for k, entry in enumerate(entries):
            if not isinstance(entry, dict):
                local.append(entry)
                continue
            path = os.path.join(folder, f"data-{index}-{k}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for record in _records(entry):
                    f.write(json.dumps(record) + "\n")
            entry = {k2: v for k2, v in entry.items() if k2 not in ("data_files", "name")}
            local.append(dict(entry, path=path))
        config["datasets"] = local
    return config


def check(config: dict, source: str) -> tuple[str, str]:
    """``(verdict, message)``: "accepted", "refused" (only features offloadkit lacks) or "failing"."""
    from offloadkit.cli.preflight import preflight
    from offloadkit.cli.train_config import TrainConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TrainConfig.from_dict(config, source=source, cuda=False).resolved(False)
            preflight(cfg)
    except ConfigProblemsError as exc:
        return ("refused" if exc.unsupported_only else "failing"), str(exc)
    except ConfigError as exc:
        return "failing", str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash is a failing config, reported
        return "failing", f"{type(exc).__name__}: {exc}"
    return "accepted", ""


def survey(checkout: str, folder: str) -> list[tuple[str, str, str, dict]]:
    """``(relative path, verdict, message, localised config)`` of every example with a base_model."""
    rows = []
    paths = sorted(glob.glob(os.path.join(checkout, "examples", "**", "*.y*ml"), recursive=True))
    for i, path in enumerate(paths):
        try:
            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(config, dict) or "base_model" not in config:
            continue
        rel = os.path.relpath(path, checkout)
        local = localise(config, folder, i)
        with contextlib.redirect_stderr(io.StringIO()):
            verdict, message = check(local, rel)
        rows.append((rel, verdict, message, local))
    return rows


def train_one(config: dict, folder: str, name: str) -> tuple[bool, str]:
    """One training step of a localised config with ``offloadkit train`` (a fresh process)."""
    config = dict(
        config,
        max_steps=1,
        sequence_len=min(int(config.get("sequence_len") or 256), 256),
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        compare=False,
        save_steps=None,
    )
    config.pop("batch_size", None)  # Axolotl's whole-step batch: one micro-batch here
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "offloadkit", "train", path], capture_output=True, text=True, env=env, timeout=600
    )
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", help="an Axolotl checkout (its examples/ folder is read)")
    parser.add_argument("--train", type=int, default=0, metavar="N", help="also train one step of N accepted configs")
    parser.add_argument("--verbose", action="store_true", help="print every config's verdict")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="offloadkit-axolotl-") as folder:
        rows = survey(args.checkout, folder)
        tally = collections.Counter(verdict for _, verdict, _, _ in rows)
        for rel, verdict, message, _ in rows:
            if verdict == "failing" or args.verbose:
                print(f"{verdict:9} {rel}: {message}")
        reasons = collections.Counter()
        for _, verdict, message, _ in rows:
            if verdict == "refused":
                for part in message.split("; ("):
                    if ": " in part and "is not something" in part or "offloadkit train" in part:
                        reasons[part.split("=")[0].split(") ")[-1].split(": ")[-1][:40]] += 1
        print(
            f"\n{len(rows)} example configs with a base_model: {tally['accepted']} accepted, {tally['refused']} "
            f"refused with one line naming a feature offloadkit does not have, {tally['failing']} failing"
        )
        print(f"accepted or refused with a reason: {tally['accepted'] + tally['refused']} of {len(rows)}")
        if reasons:
            print("refused for: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common(12)))
        if args.train:
            trained = 0
            accepted = [(rel, local) for rel, verdict, _, local in rows if verdict == "accepted"][: args.train]
            for k, (rel, local) in enumerate(accepted):
                ok, last = train_one(local, folder, f"train-{k}")
                trained += ok
                print(f"{'trained' if ok else 'FAILED '} {rel}" + ("" if ok else f": {last}"))
            print(f"one training step: {trained} of {len(accepted)} accepted configs")
    return 0 if tally["failing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
