"""Without --verifier, drafts that name other verifier paths with one weights fingerprint share
that verifier (#50 item 15: a copied target folder was refused): the fingerprint is the
verifier's identity, the recorded path a hint."""

from __future__ import annotations

import pytest

from speculators_vllm016.evaluate.runner import DraftSettings, named_verifier
from speculators_vllm016.utils.errors import InvalidInputError


def _drafts(*pairs: tuple[str | None, str | None]) -> list[DraftSettings]:
    return [DraftSettings(path, 3, verifier_fingerprint=print_) for path, print_ in pairs]


def test_one_fingerprint_under_two_paths_is_one_verifier(tmp_path):
    moved, copy = str(tmp_path / "gone"), str(tmp_path / "copy")
    (tmp_path / "copy").mkdir()
    assert named_verifier(_drafts((moved, "abc"), (copy, "abc"))) == copy
    assert named_verifier(_drafts((copy, "abc"), (moved, "abc"))) == copy


@pytest.mark.parametrize(
    ("second", "words"),
    [
        (("b", "def"), "of different weights"),
        (("b", None), "; pass --verifier"),
        ((None, "abc"), ""),
    ],
)
def test_other_weights_or_nothing_to_compare_still_need_verifier(tmp_path, second, words):
    (tmp_path / "a").mkdir()
    first = (str(tmp_path / "a"), "abc")
    with pytest.raises(InvalidInputError, match="pass --verifier") as error:
        named_verifier(_drafts(first, second))
    assert words in str(error.value)


def test_one_path_is_the_verifier():
    assert named_verifier(_drafts(("org/model", None), ("org/model", "x"))) == "org/model"
