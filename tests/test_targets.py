"""The table of TransformerLens layouts."""

from __future__ import annotations

import pytest

from safelens_tl import targets
from tests.conftest import LAYOUT, RELEASE


def test_locate_finds_the_installed_release() -> None:
    layout = targets.locate()
    assert layout.release == RELEASE
    expected = {
        2: "HookedTransformerKeyValueCacheEntry",
        3: "TransformerLensKeyValueCacheEntry",
        4: "TransformerLensKeyValueCacheEntry",
    }[targets.major_version(RELEASE) or 0]
    assert layout.entry_class.__name__ == expected
    assert layout.entry_class_path.endswith(expected)
    assert layout.cache_class.__name__.endswith("KeyValueCache")


@pytest.mark.parametrize(
    ("release", "row"),
    [("1.4.0", 0), ("2.18.0", 0), ("3.0.0", 1), ("3.9.0.dev2", 1), ("4.3.0", 2)],
)
def test_each_release_maps_to_one_row(release: str, row: int) -> None:
    assert targets.known_layout_for(release) is targets.KNOWN_LAYOUTS[row]


@pytest.mark.parametrize("release", ["0.2.0", "5.0.0"])
def test_unknown_release_is_refused_by_name(release: str) -> None:
    assert targets.known_layout_for(release) is None
    with pytest.raises(targets.UnsupportedLayoutError, match=release):
        targets.locate(release)


@pytest.mark.parametrize("release", [None, "0.0.0", "0.0.0.dev3", "0.0.0+g1234abc", "nightly"])
def test_a_version_that_says_nothing_is_recognised_by_its_classes(release: str | None) -> None:
    """A git checkout reports 0.0.0; a source tree on sys.path has no metadata at all. The
    installed classes decide, the same layout as the real release's, with a note, not a refusal."""
    layout = targets.locate(release) if release is not None else targets._recognise(None)
    real = targets.locate()
    assert layout.known is real.known
    assert (layout.entry_class, layout.cache_class) == (real.entry_class, real.cache_class)
    assert layout.note is not None and "match the known layout" in layout.note


def test_changed_signature_is_refused() -> None:
    class RenamedArguments:
        def append(self, keys: object, values: object) -> None: ...

        @classmethod
        def init_cache_entry(cls, cfg: object, device: object, batch_size: int = 1) -> None: ...

    with pytest.raises(targets.UnsupportedLayoutError, match="append"):
        targets.check_signatures(RenamedArguments)
    targets.check_signatures(LAYOUT.entry_class)  # the real one passes
