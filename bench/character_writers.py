"""Real shared-identity images for `dp-fedemb run`: characters written by many writers.

The paper's EMNIST setting with real glyphs instead of handwriting: an identity is a
character (0-9, A-Z, a-z), a user is a writer who writes in one of the Latin fonts that
matplotlib ships (mpl-data/fonts/ttf: DejaVu, STIX, Computer Modern; the same files as
Debian's fonts-dejavu-core and fonts-stix) and holds some of the characters, every image
its own render (random pose, blur, ink, paper and noise: bench/rendered_images.render).
Writers of one font share its shapes, as writers of one school share a hand; users share
identities, so the split needs `split.mode: identity` (or held_out_images).

Public data for pretraining is of another kind: matplotlib's toolbar icons and DejaVu
pictographs (bench/rendered_images' icons), one identity per public user.

    python -m bench.character_writers --root /tmp/chars --users 1500 --characters-per-user 8

writes ROOT/private/<user>/<character>/<n>.png and ROOT/public/<user>/<icon>/<n>.png, the
layout `dp-fedemb run` reads (README, "Your own images in five minutes").
"""

import argparse
import os
import string

import numpy as np
from PIL import Image

from bench import rendered_images

# Fonts with Latin letters and digits (the others are symbol and size variants).
LATIN_FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "cmr10.ttf",
    "cmb10.ttf",
    "cmss10.ttf",
    "cmtt10.ttf",
)
CHARACTERS = string.digits + string.ascii_uppercase + string.ascii_lowercase
# Identity folder names must differ by more than case on case-insensitive file systems.
_FOLDER = {
    c: (f"upper_{c}" if c.isupper() else f"lower_{c}" if c.islower() else c) for c in CHARACTERS
}


def _save(pixels: np.ndarray, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path)


def write_private(
    root: str, users: int, characters_per_user: int, images_per_character: int, size: int, seed: int
) -> int:
    """Writer u writes in font u mod len(LATIN_FONTS) a random `characters_per_user` of
    CHARACTERS, `images_per_character` renders each. Returns the images written."""
    rng = np.random.default_rng(seed)
    written = 0
    for user in range(users):
        font = LATIN_FONTS[user % len(LATIN_FONTS)]
        for character in rng.choice(list(CHARACTERS), characters_per_user, replace=False):
            for n in range(images_per_character):
                render_seed = rendered_images.seed_of("writer", seed, user, character, n, size)
                pixels = rendered_images.render(f"glyph:{font}:{character}", size, 0, render_seed)
                _save(
                    pixels, os.path.join(root, f"writer{user:05d}", _FOLDER[character], f"{n}.png")
                )
                written += 1
    return written


def write_public(root: str, users_per_icon: int, images_per_user: int, size: int, seed: int) -> int:
    """Each icon of bench/rendered_images drawn by `users_per_icon` public users."""
    written = 0
    for number, icon in enumerate(rendered_images.identities()["icons"]):
        for user in range(users_per_icon):
            for n in range(images_per_user):
                render_seed = rendered_images.seed_of("public", seed, icon, user, n, size)
                pixels = rendered_images.render(icon, size, 0, render_seed)
                _save(
                    pixels,
                    os.path.join(
                        root, f"icon{number:02d}_{user:03d}", f"icon{number:02d}", f"{n}.png"
                    ),
                )
                written += 1
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--users", type=int, default=1500)
    parser.add_argument("--characters-per-user", type=int, default=8)
    parser.add_argument("--images-per-character", type=int, default=1)
    parser.add_argument("--public-users-per-icon", type=int, default=10)
    parser.add_argument("--public-images-per-user", type=int, default=4)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    private = write_private(
        os.path.join(args.root, "private"),
        args.users,
        args.characters_per_user,
        args.images_per_character,
        args.size,
        args.seed,
    )
    public = write_public(
        os.path.join(args.root, "public"),
        args.public_users_per_icon,
        args.public_images_per_user,
        args.size,
        args.seed,
    )
    print(f"wrote {private} private and {public} public images under {args.root}")


if __name__ == "__main__":
    main()
