"""Datasets as in-memory uint8 tensors, their fixed splits, and client partitions."""

from peradapt.data.batches import iterate_minibatches, random_crop_flip, to_model_input
from peradapt.data.federation import (
    SPLIT_SEED,
    ClientData,
    FederatedData,
    FixedSplits,
    build_federation,
    fixed_splits,
    has_pretraining_split,
    pretraining_split,
)
from peradapt.data.images import Grouping, ImageSet, SourceData, fit_images, resize_images
from peradapt.data.partition import (
    PartitionSpec,
    label_histograms,
    parse_partition,
    partition_labels,
    split_test_like_train,
)
from peradapt.data.sources import SOURCE_NAMES, SOURCE_PATTERNS, load_source, load_unlabeled, read_idx

__all__ = [
    "SOURCE_NAMES",
    "SOURCE_PATTERNS",
    "SPLIT_SEED",
    "ClientData",
    "FederatedData",
    "FixedSplits",
    "Grouping",
    "ImageSet",
    "PartitionSpec",
    "SourceData",
    "build_federation",
    "fit_images",
    "fixed_splits",
    "has_pretraining_split",
    "iterate_minibatches",
    "label_histograms",
    "load_source",
    "load_unlabeled",
    "parse_partition",
    "partition_labels",
    "pretraining_split",
    "random_crop_flip",
    "read_idx",
    "resize_images",
    "split_test_like_train",
    "to_model_input",
]
