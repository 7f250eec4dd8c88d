"""Dataset records as users write them: every malformed record stops the run with one line
naming the file, the record and the fix, instead of training on Python's ``str()`` of it."""

import json

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
