"""The TFDS datasets this project writes itself (the local and docs_prose training corpora, the synthetic evaluation
sets): one-split builders of text records, prepared once among any number of concurrent processes, quietly."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable
from pathlib import Path

from mot_jax.paths import cache_lock


@contextlib.contextmanager
def quiet_tfds():
    """No TFDS progress bars, absl warnings or stdout lines (we print our own one line)."""
    import tensorflow_datasets as tfds
    from absl import logging
    from tensorflow_datasets.core.utils import tqdm_utils

    bar, verbosity = getattr(tqdm_utils, "_active", True), logging.get_verbosity()
    tfds.display_progress_bar(False)
    logging.set_verbosity(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        tfds.display_progress_bar(bar)
        logging.set_verbosity(verbosity)


def one_split_builder(builder_name: str, split: str, feature: str, config: str, data_dir: Path, metadata=False):
    """An unregistered TFDS builder `builder_name`/`config` under `data_dir` of one `split` of {`feature`: text}
    records, unshuffled, in the order of `builder.records` (texts; set it before `download_and_prepare`): the form of
    the datasets this project writes itself (local and docs_prose corpora, synthetic evaluation sets). `metadata`: the
    info carries a MetadataDict to fill before preparing."""
    import tensorflow_datasets as tfds

    class OneSplitBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = builder_name
        VERSION = tfds.core.Version("1.0.0")
        code_path = None  # no checksums file to look for (TFDS's lookup needs importlib_resources in a package)
        records: Iterable[str] = ()

        def _info(self):
            features = tfds.features.FeaturesDict({feature: tfds.features.Text()})
            extra = dict(metadata=tfds.core.MetadataDict()) if metadata else {}
            return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True, **extra)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples()}

        def _generate_examples(self):
            yield from enumerate({feature: text} for text in self.records)

    return OneSplitBuilder(
        config=tfds.core.BuilderConfig(name=config), data_dir=str(data_dir), file_format="array_record"
    )


def prepared(make: Callable[[], object], build: Callable[[object], None]):
    """The TFDS builder `make()` returns, prepared by `build(builder)` when it is not yet: safe for any number of
    processes at once. The build holds the dataset's own lock (TFDS writes to a temporary folder and renames it);
    a process that waited makes a fresh builder, whose info holds the splits the other process wrote."""
    with quiet_tfds():
        builder = make()
        if builder.is_prepared():
            return builder
    with cache_lock(builder.data_dir):
        with quiet_tfds():
            builder = make()
            ready = builder.is_prepared()
        if not ready:
            build(builder)
    return builder
