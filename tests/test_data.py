"""Corpora (local files through TFDS array_record), chunk tables, batches and their checkpointable positions."""

from __future__ import annotations

import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mot_jax.errors import MotJaxError
from mot_jax.training import chunk_table, corpus, data
from mot_jax.training.chunk_table import MIN_DOCUMENT_TOKENS, TextChunks
from mot_jax.translate.align import adapter

PARAGRAPHS = [
    "The river ran quietly past the old mill, where the miller's daughter sat counting the boats that drifted "
    "downstream toward the sea. Nobody in the village remembered when the wheel had last turned.",
    "In the autumn the orchards filled with pickers who came from the hills, carrying baskets and singing songs "
    "that their grandparents had taught them. The apples were sorted by size and sent to market by cart.",
    "A good teacher explains an idea twice: once so that it can be understood, and once so that it cannot be "
    "misunderstood. Her students learned to ask why before they asked how.",
    "The library kept its rarest books in a cold room behind a heavy door. Visitors had to wear gloves, speak "
    "softly, and write down every page they turned in a ledger by the window.",
    "When the storm finally broke, the fishermen pulled their nets ashore and waited in the harbour tavern, "
    "trading stories about waves as tall as houses and winds that could lift a roof.",
    "Mathematics rewards patience. A proof that seems impossible on Monday may become obvious by Friday, after "
    "a long walk, a night of sleep, and a page of careful calculations that led nowhere.",
    "The train to the capital left at dawn. Travellers bought bread and cheese on the platform, checked their "
    "tickets again, and watched the fields turn gold as the sun rose over the valley.",
    "Every spring the town held a fair with music, games and a contest for the largest pumpkin, which the baker "
    "won three years in a row with a vegetable nearly too heavy to lift.",
]
T, P, B, S = 32, 16, 4, 48  # small chunks (15 context, 16 prompt tokens), batch size, source length


def bpe(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(PARAGRAPHS, trainer)
    return tok


@pytest.fixture(scope="module")
def target():
    return bpe(600)


@pytest.fixture(scope="module")
def source():
    return bpe(300)


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 1-4 shuffled sentences, plus an empty, a blank and a too-short (< 8 token) document."""
    sentences = [s.strip() + "." for p in PARAGRAPHS for s in p.split(".") if s.strip()]
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(sentences, rng.integers(1, 5))) for _ in range(count)]
    return docs[:3] + ["", "   \n", "Hi."] + docs[3:]


def ids(tok, text) -> list[int]:
    return adapter(tok).encode(text)[0]


def eos(tok) -> int:
    return tok.token_to_id("</s>")


# ------------------------------------------------------------------------------------------------------ corpus


def write_corpus(root):
    """A folder of every supported format (and an ignored .csv); returns the documents in reading order."""
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First document.\nIt has two lines.", encoding="utf-8")
    jsonl = [f"Line {i}: {PARAGRAPHS[i % len(PARAGRAPHS)]}" for i in range(60)]
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(jsonl)) + "\n\n")
    paragraphs = [f"Paragraph {i}. {PARAGRAPHS[i % len(PARAGRAPHS)]}" for i in range(120)]
    (root / "big.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    parquet = ["Café naïve — parquet one.", "parquet two", "parquet three"]
    pq.write_table(pa.table({"text": parquet}), root / "c.parquet")
    (root / "sub" / "d.txt").write_text("Nested document ✓", encoding="utf-8")
    (root / "e.csv").write_text("text\nignored")
    return ["First document.\nIt has two lines.", *jsonl, paragraphs, *parquet, "Nested document ✓"]


def test_local_corpus_reads_back_with_a_disjoint_validation_split(tmp_path, monkeypatch):
    expected = write_corpus(tmp_path / "corpus")
    docs = corpus.documents(str(tmp_path / "corpus"), data_dir=tmp_path / "tfds")
    train, validation = list(docs["train"]), list(docs["validation"])
    rest, held_out = iter(train), iter(validation)
    every = corpus.VALIDATION_EVERY
    read = [next(held_out if i % every == every - 1 else rest) for i in range(len(train) + len(validation))]
    assert next(rest, None) is None and next(held_out, None) is None
    big = next(i for i, e in enumerate(expected) if isinstance(e, list))  # big.txt: split into paragraph groups
    groups = read[big : big + len(read) - len(expected) + 1]
    assert len(groups) > 1 and all(len(g) <= corpus.DOCUMENT_CHARS for g in groups)
    assert "\n\n".join(groups) == "\n\n".join(expected[big])
    assert read[:big] + read[big + len(groups) :] == expected[:big] + expected[big + 1 :]
    assert len(validation) == len(read) // every and not set(validation) & set(train)
    assert docs["train"][-1] == train[-1] and docs["train"][1:3] == train[1:3]

    monkeypatch.setattr(corpus, "_read_local", lambda files: pytest.fail("rebuilt"))
    assert list(corpus.documents(str(tmp_path / "corpus"), data_dir=tmp_path / "tfds")["train"]) == train


def test_local_corpus_is_reprepared_when_a_file_changes(tmp_path):
    (tmp_path / "docs.txt").write_text("one version of the text")
    first = corpus.documents(str(tmp_path / "docs.txt"), data_dir=tmp_path / "tfds")
    (tmp_path / "docs.txt").write_text("another version of the text")
    second = corpus.documents(str(tmp_path / "docs.txt"), data_dir=tmp_path / "tfds")
    assert first["train"][0] == "one version of the text" and second["train"][0] == "another version of the text"
    assert first["train"].fingerprint != second["train"].fingerprint


@pytest.mark.parametrize(
    "files,message",
    [
        ({"x.jsonl": '{"text": "fine"}\n{"text": "fine"}\nnot json\n'}, "x.jsonl:3: not valid JSON"),
        ({"x.jsonl": '{"text": "fine"}\n{"body": "no text"}\n'}, "x.jsonl:2: the line has no 'text'"),
        ({"x.jsonl": b'{"text": "fine"}\n{"text": "\xff"}\n'}, "x.jsonl:2: not UTF-8 text"),
        ({"x.csv": "text\n"}, "has no .txt, .jsonl or .parquet file"),
        ({"x.parquet": pa.table({"body": ["a"]})}, "x.parquet has no 'text' column"),
        ({"x.txt": b"\xff\xfe bad"}, "x.txt is not UTF-8"),
    ],
)
def test_bad_local_corpora_name_the_problem(tmp_path, files, message):
    for name, content in files.items():
        if isinstance(content, pa.Table):
            pq.write_table(content, tmp_path / name)
        elif isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content)
    with pytest.raises(MotJaxError, match=message):
        corpus.documents(str(tmp_path), data_dir=tmp_path / "tfds")


def test_unknown_corpora_name_the_accepted_forms(tmp_path):
    with pytest.raises(MotJaxError, match="does not exist"):
        corpus.documents(str(tmp_path / "missing"), data_dir=tmp_path)
    with pytest.raises(MotJaxError, match="Unknown corpus scheme 'hub'.*docs_prose.*tfds:NAME"):
        corpus.documents("hub:something", data_dir=tmp_path)


def test_huggingface_corpus_without_datasets_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MotJaxError, match="pip install datasets"):
        corpus.documents("huggingface:wikitext", data_dir=tmp_path)


# ------------------------------------------------------------------------------------------------------ chunks


def stream_of(docs, tok) -> np.ndarray:
    """The reference stream, written out directly: kept documents' ids, each followed by EOS."""
    out = []
    for doc in docs:
        doc_ids = ids(tok, doc) if doc.strip() else []
        if len(doc_ids) >= MIN_DOCUMENT_TOKENS:
            out += doc_ids + [eos(tok)]
    return np.array(out, np.int32)


def test_chunks_are_the_packed_stream(tmp_path, target):
    docs = make_documents(200)
    chunks = TextChunks(docs, target, eos_id=eos(target), total_tokens=T, prefix_tokens=P, cache_dir=tmp_path)
    stream = stream_of(docs, target)
    np.testing.assert_array_equal(chunks.chunks, stream[: len(stream) // T * T].reshape(-1, T))
    assert chunks.chunks.dtype == np.int32 and chunks.stats["kept_documents"] == len(docs) - 3
    batch = data.make_batch(chunks.chunks[:4], P, target, target, P - 1)
    np.testing.assert_array_equal(batch.context, chunks.chunks[:4, : P - 1])
    np.testing.assert_array_equal(batch.prompt, chunks.chunks[:4, P - 1 : T - 1])
    np.testing.assert_array_equal(batch.labels, chunks.chunks[:4, P:])
    np.testing.assert_array_equal(batch.labels[:, :-1], batch.prompt[:, 1:])  # labels: the prompt shifted by one
    assert batch.context_mask.all() and batch.label_mask.all()
    np.testing.assert_array_equal(batch.source_ids, batch.context)  # same tokenizer: identity


def test_contexts_too_long_for_the_source_are_dropped(tmp_path, target, source):
    docs = make_documents(200)
    kwargs = dict(eos_id=eos(target), total_tokens=T, prefix_tokens=P, cache_dir=tmp_path)
    every = TextChunks(docs, target, **kwargs).chunks
    lengths = np.array([len(ids(source, adapter(target).decode(c[: P - 1]))) for c in every])
    limit = int(np.median(lengths))
    kept = TextChunks(docs, target, source_tokenizer=source, source_length=limit, **kwargs)
    np.testing.assert_array_equal(kept.chunks, every[lengths <= limit])
    assert kept.stats["dropped"] == (lengths > limit).sum() > 0
    assert kept.stats["source_length_max"] == lengths.max()


def test_chunk_table_is_cached(tmp_path, target, source, monkeypatch):
    docs = make_documents(200)
    kwargs = dict(eos_id=eos(target), total_tokens=T, prefix_tokens=P, source_tokenizer=source, source_length=S)
    first = TextChunks(docs, target, cache_dir=tmp_path, **kwargs)
    assert first.path.is_file()
    monkeypatch.setattr(chunk_table, "_token_stream", lambda *a: pytest.fail("re-tokenized"))
    monkeypatch.setattr(chunk_table, "_source_lengths", lambda *a: pytest.fail("re-tokenized"))
    second = TextChunks(docs, target, cache_dir=tmp_path, **kwargs)
    np.testing.assert_array_equal(first.chunks, second.chunks)
    assert second.path == first.path and second.stats == first.stats
    assert isinstance(second.chunks, np.memmap)  # read from disk as batches take it, not loaded whole
    with pytest.raises(pytest.fail.Exception, match="re-tokenized"):  # a different key is a different table
        TextChunks(docs, target, cache_dir=tmp_path, **(kwargs | dict(source_length=S + 1)))


def test_chunks_of_a_prepared_corpus_live_in_its_data_dir(tmp_path, target):
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in make_documents(100)))
    docs = corpus.documents(str(tmp_path / "c.jsonl"), data_dir=tmp_path / "tfds")["train"]
    kwargs = dict(eos_id=eos(target), total_tokens=T, prefix_tokens=P)
    chunks = TextChunks(docs, target, **kwargs)
    assert chunks.path.parent == tmp_path / "tfds" / "chunks" and len(chunks) > 10
    np.testing.assert_array_equal(chunks.chunks, TextChunks(list(docs), target, cache_dir=tmp_path, **kwargs))


def test_a_document_cap_tokenizes_only_the_first_documents(tmp_path, target, monkeypatch):
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in make_documents(100)))
    docs = corpus.documents(str(tmp_path / "c.jsonl"), data_dir=tmp_path / "tfds")["train"]
    kwargs = dict(eos_id=eos(target), total_tokens=T, prefix_tokens=P)
    assert docs.head(len(docs)) is docs and docs.head(len(docs) + 5) is docs
    capped = TextChunks(docs.head(30), target, **kwargs)
    assert capped.stats["documents"] == 30 and capped.path != TextChunks(docs, target, **kwargs).path
    np.testing.assert_array_equal(capped.chunks, TextChunks(list(docs)[:30], target, cache_dir=tmp_path, **kwargs))
    read, get = set(), corpus.Documents.__getitem__

    def recorded(self, i):  # the corpus rows a read takes
        rows = list(range(len(self))[i] if isinstance(i, slice) else [i])
        read.update(np.asarray(rows if self.indices is None else self.indices[rows]).tolist())
        return get(self, i)

    monkeypatch.setattr(corpus.Documents, "__getitem__", recorded)
    TextChunks(docs.head(20), target, cache_dir=tmp_path / "fresh", **kwargs)
    assert read == set(docs.indices[:20].tolist())  # the first 20 documents, nothing past the cap


def test_transformers_tokenizers_give_the_same_chunks_and_batches(tmp_path, target, source):
    from transformers import PreTrainedTokenizerFast

    hf_target, hf_source = (PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>") for t in (target, source))
    docs, kwargs = make_documents(100), dict(total_tokens=T, prefix_tokens=P, source_length=S)
    with pytest.raises(MotJaxError, match="pass the target's EOS id"):
        TextChunks(docs, target, cache_dir=tmp_path, **kwargs)
    raw = TextChunks(docs, target, eos_id=eos(target), source_tokenizer=source, cache_dir=tmp_path / "a", **kwargs)
    hf = TextChunks(docs, hf_target, source_tokenizer=hf_source, cache_dir=tmp_path / "b", **kwargs)
    np.testing.assert_array_equal(raw.chunks, hf.chunks)  # EOS taken from the transformers tokenizer
    assert_batches_equal(
        data.Batches(raw, B, 0, source, target, S).batch(3), data.Batches(hf, B, 0, hf_source, hf_target, S).batch(3)
    )


# ----------------------------------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def chunks(tmp_path_factory, target, source):
    return TextChunks(
        make_documents(300),
        target,
        eos_id=eos(target),
        total_tokens=T,
        prefix_tokens=P,
        source_tokenizer=source,
        source_length=S,
        cache_dir=tmp_path_factory.mktemp("chunks"),
    )


def assert_batches_equal(a: data.Batch, b: data.Batch):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_batches_are_a_pure_function_of_the_position(chunks, target, source):
    first, second = (data.Batches(chunks, B, 7, source, target, S) for _ in range(2))
    for position in [5, 0, 123, 5]:
        assert_batches_equal(first.batch(position), second.batch(position))
    other_seed = data.Batches(chunks, B, 8, source, target, S)
    assert not np.array_equal(other_seed.batch(0).context, first.batch(0).context)


def test_positions_walk_a_new_permutation_each_epoch(chunks, target, source):
    batches = data.Batches(chunks, B, 7, source, target, S)
    n = batches.num_chunks
    assert n == len(chunks) and n % B  # so a batch crosses the epoch boundary
    walked = np.concatenate([batches.indices(p) for p in range(2 * n // B)])
    epochs = [np.random.default_rng([7, e]).permutation(n) for e in range(2)]
    np.testing.assert_array_equal(walked, np.concatenate(epochs)[: len(walked)])
    assert not np.array_equal(epochs[0], epochs[1])
    assert batches.epoch_of(n // B) == 0 and batches.epoch_of(n // B + 1) == 1  # batch n // B crosses into epoch 1
    np.testing.assert_array_equal(batches.batch(n // B).context, chunks.chunks[walked[n // B * B :][:B], : P - 1])


def test_batches_have_static_shapes_and_source_ids_read_the_context(chunks, target, source):
    batches = data.Batches(chunks, B, 0, source, target, S)
    for position in range(0, 40, 3):
        batch = batches.batch(position)
        shapes = dict(
            context=(B, P - 1),
            context_mask=(B, P - 1),
            prompt=(B, T - P),
            labels=(B, T - P),
            label_mask=(B, T - P),
            source_ids=(B, S),
            source_mask=(B, S),
        )
        for name, shape in shapes.items():
            assert getattr(batch, name).shape == shape, name
        assert batch.alignment.weights.shape == (B, P - 1, S) and batch.source_ids.dtype == np.int32
        for b in range(B):
            text = adapter(target).decode(batch.context[b])
            assert adapter(source).decode(batch.source_ids[b][batch.source_mask[b]]) == text
            assert not batch.source_ids[b][~batch.source_mask[b]].any()
        np.testing.assert_allclose(batch.alignment.weights.sum(-1), 1, rtol=1e-6)


def test_validation_batches_are_in_order_and_full(chunks, target, source):
    val = data.validation_batches(chunks, B, source, target, S)
    assert len(val) == len(chunks) // B
    np.testing.assert_array_equal(np.concatenate([v.context for v in val]), chunks.chunks[: len(val) * B, : P - 1])
    assert len(data.validation_batches(chunks, B, source, target, S, max_batches=2)) == 2
    with pytest.raises(MotJaxError, match="fewer than batch_size"):
        data.validation_batches(chunks.chunks[:3], B, source, target, S, prefix_tokens=P)


def test_prefetch_yields_the_same_batches(chunks, target, source):
    batches = data.Batches(chunks, B, 3, source, target, S)
    for position, batch in zip(range(10, 16), data.prefetch(batches, 10, 6), strict=True):
        assert_batches_equal(batch, batches.batch(position))
    early = data.prefetch(batches, 0, 100)
    next(early)
    early.close()  # stops the worker thread


@pytest.mark.slow
def test_docs_prose_holds_a_million_tokens():
    from mot_jax.models.gguf import load_tokenizer

    docs = corpus.documents(corpus.DEFAULT_CORPUS)
    assert len(docs["validation"]) >= 0.015 * len(docs["train"])
    texts = list(docs["train"])
    for name in ["gemma3-270m", "smollm2-135m"]:
        tokens = sum(len(e.ids) for e in load_tokenizer(name).encode_batch(texts, add_special_tokens=False))
        assert tokens >= 1_000_000, name


def test_retrieval_rows_repeat_a_span_of_their_own_context(chunks, target, source):
    """With copy_fraction, the chosen rows' prompt and labels are consecutive tokens of their own context (after its
    first token), the other rows are the plain chunks, the draw depends on the position alone, and the context and
    source side are untouched."""
    split = dict(prefix_tokens=24, source_length=2 * S)  # a 23-token context, a 9-token prompt and its labels
    plain = data.Batches(chunks.chunks, B, 7, source, target, **split)
    copied = [data.Batches(chunks.chunks, B, 7, source, target, **split, copy_fraction=0.5) for _ in range(2)]
    kinds = []
    for position in range(12):
        want, got = plain.batch(position), copied[0].batch(position)
        assert_batches_equal(got, copied[1].batch(position))
        for name in ("context", "source_ids", "label_mask"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        for b in range(B):
            if np.array_equal(got.prompt[b], want.prompt[b]):
                kinds.append(False)
                np.testing.assert_array_equal(got.labels[b], want.labels[b])
                continue
            kinds.append(True)
            stream = np.concatenate([got.prompt[b], got.labels[b][-1:]])
            starts = [s for s in range(1, 23) if np.array_equal(got.context[b, s : s + len(stream)], stream)]
            assert starts, (position, b)
            np.testing.assert_array_equal(got.labels[b], stream[1:])
    assert 0.25 < np.mean(kinds) < 0.75
    everything = data.Batches(chunks.chunks, B, 7, source, target, **split, copy_fraction=1.0).batch(3)
    assert not any(np.array_equal(everything.prompt[b], plain.batch(3).prompt[b]) for b in range(B))


def copied_span(got: data.Batch, plain: data.Batch, b: int) -> int:
    """Asserts that row b of `got` is row b of `plain` (the same chunk) made a retrieval row: the same context and
    source side, prompt[:n] = context[s : s + n] and labels[:n] = context[s + 1 : s + n + 1] for some s >= 1, the
    labels past n masked and the rest of the chunk untouched; returns n."""
    for name in ("context", "context_mask", "source_ids", "source_mask"):
        np.testing.assert_array_equal(getattr(got, name)[b], getattr(plain, name)[b])
    n = int(got.label_mask[b].sum())
    assert n >= 1 and got.label_mask[b, :n].all()
    stream = np.concatenate([got.prompt[b, :n], got.labels[b, n - 1 : n]])
    context = got.context[b]
    assert any(np.array_equal(context[s : s + n + 1], stream) for s in range(1, len(context) - n)), b
    np.testing.assert_array_equal(got.labels[b, :n], stream[1:])
    np.testing.assert_array_equal(got.prompt[b, n + 1 :], plain.prompt[b, n + 1 :])  # the masked tail: as it was
    return n


def test_held_out_retrieval_rows_are_their_own_chunks_repeating_their_context(chunks, target, source):
    """`retrieval_batches` (the closing table's retrieval column) makes every row of the validation batches it is
    given a retrieval row by training's rule, seeded: with a context longer than the prompt the whole prompt is
    copied; with the default split's shorter context (15 tokens, a 16-token prompt) the copy goes as far as the
    context does (13 labels) and the rest are masked, as training rows with copy_fraction then are."""
    for prefix_tokens, copied in ((24, T - 24), (P, P - 3)):  # the span starts anywhere in 1..14; at 1
        split = dict(prefix_tokens=prefix_tokens, max_batches=2)
        plain = data.validation_batches(chunks, B, source, target, 2 * S, **split)
        got = data.retrieval_batches(plain, seed=3)
        for a, b in zip(got, data.retrieval_batches(plain, seed=3)):
            assert_batches_equal(a, b)
        if prefix_tokens == 24:
            assert not np.array_equal(got[0].prompt, data.retrieval_batches(plain, seed=4)[0].prompt)
        for batch, want in zip(got, plain):
            assert [copied_span(batch, want, b) for b in range(B)] == [copied] * B
    training = data.Batches(chunks, B, 7, source, target, 2 * S, copy_fraction=1.0)
    plain = data.Batches(chunks, B, 7, source, target, 2 * S).batch(0)
    assert [copied_span(training.batch(0), plain, b) for b in range(B)] == [P - 3] * B


def test_retrieval_rows_need_a_context_to_copy(chunks, target, source):
    with pytest.raises(MotJaxError, match="leaves none to copy"):
        data.Batches(chunks.chunks, B, 7, source, target, S, prefix_tokens=3, copy_fraction=0.5)
    with pytest.raises(MotJaxError, match=r"\(1.5, 0.0, 0.0\) are shares of a batch's rows; pass values of at least 0"):
        data.Batches(chunks, B, 7, source, target, S, copy_fraction=1.5)
