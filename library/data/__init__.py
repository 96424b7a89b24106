"""The dataset layer: config schema, discovery, captions, buckets, batches and caches.

The training loop needs only what is re-exported here.
"""

from library.data.batching import BatchRef
from library.data.captions import CaptionSettings, process_caption
from library.data.config import DatasetConfig, SubsetConfig, resolve_datasets
from library.data.dataset import (
    BatchDataset,
    DataFamilyInfo,
    TrainingData,
    build_training_data,
)
from library.data.validation_split import split_for_validation

__all__ = [
    "BatchDataset", "BatchRef", "CaptionSettings", "DataFamilyInfo", "DatasetConfig", "SubsetConfig",
    "TrainingData", "build_training_data", "process_caption", "resolve_datasets", "split_for_validation",
]
