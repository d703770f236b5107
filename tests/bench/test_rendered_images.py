"""The dedup benchmark's rendered low-detail images (bench/rendered_images.py): real font
and icon files from matplotlib, every image its own render, split modes as documented."""

import numpy as np
import pytest

from bench import rendered_images


def test_every_image_is_its_own_render_and_renders_are_reproducible():
    identity = rendered_images.identities()["characters"][0]
    first = [rendered_images.render(identity, 28, 2, seed) for seed in range(4)]
    again = [rendered_images.render(identity, 28, 2, seed) for seed in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(not np.array_equal(first[i], first[j]) for i in range(4) for j in range(i + 1, 4))
    assert first[0].shape == (32, 32) and first[0].dtype == np.uint8
    # A glyph was drawn: ink well below the paper somewhere.
    assert all(np.percentile(r, 99) - r.min() > 80 for r in first)


def test_split_modes_put_identities_and_users_where_they_belong():
    by_user = rendered_images.originals(28, rendered_images.BY_USER, 2, "icons")
    by_identity = rendered_images.originals(28, rendered_images.BY_IDENTITY, 2, "icons")
    identities = rendered_images.identities()["icons"]
    assert len(by_user) == len(by_identity) == 2 * len(identities)
    # by_user: every identity on both sides (one user each); by_identity: none on both.
    assert {o.group for o in by_user if o.reference} == set(identities)
    assert {o.group for o in by_user if not o.reference} == set(identities)
    assert not {o.group for o in by_identity if o.reference} & {
        o.group for o in by_identity if not o.reference
    }
    # The same renders in both modes: only the sides differ.
    assert all(np.array_equal(a.canvas, b.canvas) for a, b in zip(by_user, by_identity))


def test_unknown_split_mode_is_refused():
    with pytest.raises(ValueError, match="split mode must be one of"):
        rendered_images.originals(28, "by_photo", 2, "icons")


def test_character_writers_share_identities_in_the_run_layout(tmp_path):
    from bench import character_writers

    written = character_writers.write_private(str(tmp_path), 3, 4, 1, 28, seed=0)
    assert written == 12
    users = sorted(p.name for p in tmp_path.iterdir())
    assert users == ["writer00000", "writer00001", "writer00002"]
    folders = [sorted(q.name for q in (tmp_path / u).iterdir()) for u in users]
    assert all(len(f) == 4 for f in folders)
    # Case-distinct characters get case-distinct folder names ("upper_O", "lower_o").
    names = set(character_writers._FOLDER.values())
    assert len({n.lower() for n in names}) == len(character_writers.CHARACTERS)
