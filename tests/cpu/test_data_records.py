"""Dataset records as users write them: every malformed record stops the run with one line
naming the file, the record and the fix, instead of training on Python's ``str()`` of it."""

import json
from pathlib import Path

import pytest

from offloadkit.data import load_texts


@pytest.mark.parametrize(
    "value, shown", [(None, "NoneType null"), (5, "int 5"), (["a", "b"], 'list ["a", "b"]'), ({"x": 1}, "dict")]
)
def test_text_that_is_not_a_string_is_refused(tmp_path, value, shown):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(ValueError) as err:
        load_texts(str(path))
    message = str(err.value)
    assert f"{path}:2:" in message and shown in message and "not a string" in message


def test_json_array_names_the_record(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": 3.5}]))
    with pytest.raises(ValueError, match=r"train\.json\[1\]: 'text' is float 3\.5"):
        load_texts(str(path))


def test_string_records_still_load(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "one"}\n"two"\n')
    assert load_texts(str(path)) == ["one", "two"]


def _not_utf8_message(path: str, read) -> str:
    with pytest.raises(ValueError) as err:
        read(path)
    assert not isinstance(err.value, UnicodeDecodeError), "the codec's error names no file"
    return str(err.value)


@pytest.mark.parametrize(
    "name, data, byte, line",
    [
        ("train.txt", "hello\nwörld\n".encode("latin1"), 7, 2),
        ("train.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 28, 2),
        ("train.json", b'[{"text": "ok"},\n {"text": "caf\xe9"}]', 31, 2),
    ],
    ids=["txt", "jsonl", "json"],
)
def test_a_file_that_is_not_utf8_is_named_with_the_byte_and_the_fix(tmp_path, monkeypatch, name, data, byte, line):
    from offloadkit.data.sft import load_records

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(data)
    readers = [load_texts] + ([load_records] if name != "train.txt" else [])
    for read in readers:
        message = _not_utf8_message(name, read)
        assert message.startswith(f"{name}: not UTF-8 (byte {byte}, line {line})"), message
        assert "re-encode it as UTF-8" in message and "iconv -f latin1 -t utf-8" in message
        assert len(message) <= 200 and "\n" not in message


def test_the_invalid_byte_is_counted_from_the_start_of_the_file(tmp_path, monkeypatch):
    """Past the first read buffer, and for a character split between two reads."""
    monkeypatch.chdir(tmp_path)
    start = (1 << 20) - 1  # the last byte of the first 1 MiB
    Path("train.txt").write_bytes(b"x" * start + b"\xe9abc")
    assert "(byte 1048575, line 1)" in _not_utf8_message("train.txt", load_texts)
    Path("train.jsonl").write_bytes(b'{"text": "a"}\n' * 100_000 + b'{"text": "\xff"}\n')
    assert f"(byte {14 * 100_000 + 10}, line 100001)" in _not_utf8_message("train.jsonl", load_texts)


def test_a_utf16_file_is_told_to_convert_from_utf16(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.jsonl").write_bytes('{"text": "hi"}\n'.encode("utf-16"))
    assert "iconv -f utf-16 -t utf-8 train.jsonl > train.utf8.jsonl" in _not_utf8_message("train.jsonl", load_texts)
