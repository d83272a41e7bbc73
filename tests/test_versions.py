"""tfgc relies on private TensorFlow and Keras names; importing the strategy warns once,
naming the versions, when the installed ones are outside those the names were checked
against (tfgc/distribute/versions.py)."""

import pytest


def test_versions_outside_the_checked_range_are_named_once(monkeypatch):
    from tfgc.distribute import versions

    checked = {"tensorflow": "2.21.0", "tf-keras": "2.21.3", "keras": "3.15.1"}
    assert versions.unchecked(checked) == []
    newer = dict(checked, tensorflow="2.22.0rc1", keras="3.16.0")
    assert [(d, v) for d, v, _ in versions.unchecked(newer)] == [("tensorflow", "2.22.0rc1"),
                                                                  ("keras", "3.16.0")]
    assert versions.unchecked({"tensorflow": "2.21.0"}) == []  # Keras packages optional
    monkeypatch.setattr(versions, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"tensorflow 2\.22\.0rc1 \(checked: >=2\.21,<2\.22\)"):
        assert versions.warn_if_unchecked(newer)
    assert not versions.warn_if_unchecked(newer)  # once per process
    # What is installed here is what tfgc was checked against.
    assert versions.unchecked() == [], versions.unchecked()
