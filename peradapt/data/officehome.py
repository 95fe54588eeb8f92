"""Office-Home (Venkateswara et al. 2017): 65 classes of objects in four domains, for feature-shift federations.

Layout: ``DIR/`` (or ``DIR/OfficeHome/``, ``DIR/OfficeHomeDataset_10072016/``) holding ``Art/``, ``Clipart/``,
``Product/`` and ``Real_World/``, each with one sub-folder of images per class. The class folders are the same
in every domain; sorted by name, they give the class indices. Office-Home has no test split of its own: the fixed
split carves one (and the server's validation images) from all images, as PerAda's Table 6 does.

Images are decoded as RGB, squeezed whole to the model's square and normalized with ImageNet's statistics, which
is also what the PerAda authors' code (datasets/office_home.py) feeds its models: a fixed 224×224 resize, no
augmentation. ``resize="center-crop"`` keeps the aspect ratio instead; ``channels=1`` converts to luma.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from peradapt.data.decode import decode_images
from peradapt.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Grouping,
    ImageSet,
    SourceData,
    channel_statistics,
    resize_images,
)
from peradapt.errors import DataError

DOMAINS = ("Art", "Clipart", "Product", "Real_World")
# The official archive spells the last domain with a space.
_DOMAIN_FOLDERS = {domain: (domain, domain.replace("_", " ")) for domain in DOMAINS}
_ROOT_FOLDERS = (".", "OfficeHome", "OfficeHomeDataset_10072016")
_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
_WHERE = (
    "peradapt cannot download it: get OfficeHomeDataset_10072016.zip from "
    "https://www.hemanthdv.org/officeHomeDataset.html and extract it into DIR"
)


def load_office_home(
    data_dir: Path | None, image_size: int, *, channels: int | None = None, resize: str = "squeeze"
) -> SourceData:
    """All Office-Home images with their classes and domains (``test`` is ``None``), decoded at ``image_size`` px
    as ``resize`` says (see `peradapt.data.decode`), in RGB (``channels`` None or 3) or grey."""
    domain_dirs = _find_domain_dirs(data_dir)
    classes = _class_names(domain_dirs)
    files: list[Path] = []
    labels: list[int] = []
    domains: list[int] = []
    for domain, directory in enumerate(domain_dirs):
        for label, name in enumerate(classes):
            images = sorted(p for p in (directory / name).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
            files += images
            labels += [label] * len(images)
            domains += [domain] * len(images)
    if not files:
        raise DataError(f"no images (.jpg, .jpeg, .png) in the class folders under {domain_dirs[0].parent}")
    channels = channels or 3
    colour = decode_images(files, image_size, "RGB", name="office-home", resize=resize)
    train = ImageSet(
        images=resize_images(colour, None, channels),  # grey by the luma of the RGB pixels, as for array sources
        labels=torch.tensor(labels, dtype=torch.int64),
        num_classes=len(classes),
    )
    mean, std = channel_statistics(IMAGENET_MEAN, IMAGENET_STD, channels)
    domain_groups = Grouping("domains", np.asarray(domains, dtype=np.int64), DOMAINS)
    return SourceData("office-home", train, None, mean, std, domains=domain_groups, classes=tuple(classes))


def _find_domain_dirs(data_dir: Path | None) -> list[Path]:
    if data_dir is None:
        raise DataError(f"office-home needs --data-dir DIR holding {', '.join(d + '/' for d in DOMAINS)}. {_WHERE}")
    for root in (data_dir / folder for folder in _ROOT_FOLDERS):
        found = [_existing(root, _DOMAIN_FOLDERS[domain]) for domain in DOMAINS]
        if all(found):
            return [path for path in found if path is not None]
    looked_in = ", ".join(str(data_dir / folder) for folder in _ROOT_FOLDERS)
    raise DataError(f"Office-Home not found: looked for {', '.join(d + '/' for d in DOMAINS)} in {looked_in}. {_WHERE}")


def _existing(root: Path, names: tuple[str, ...]) -> Path | None:
    return next((root / name for name in names if (root / name).is_dir()), None)


def _class_names(domain_dirs: list[Path]) -> tuple[str, ...]:
    per_domain = [sorted(p.name for p in directory.iterdir() if p.is_dir()) for directory in domain_dirs]
    for directory, names in zip(domain_dirs[1:], per_domain[1:], strict=True):
        if names != per_domain[0]:
            differ = sorted(set(names) ^ set(per_domain[0]))
            raise DataError(
                f"{directory} and {domain_dirs[0]} hold different class folders (e.g. {', '.join(differ[:3])}); "
                "every domain needs the same classes"
            )
    if not per_domain[0]:
        raise DataError(f"{domain_dirs[0]} has no class folders: each domain needs one sub-folder per class")
    return tuple(per_domain[0])
