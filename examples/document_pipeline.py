"""A document pipeline: a fan-out over pages, then a child workflow that indexes the text."""

from __future__ import annotations

from cyclone_dsl import NodeRef, Ref, child, for_each, step, workflow


@step(name="doc_split")
def split(document: dict[str, object]) -> list[str]:
    """Pages of at most ten words."""
    words = str(document["text"]).split()
    return [" ".join(words[i : i + 10]) for i in range(0, len(words), 10)]


@step(name="doc_ocr_page", max_attempts=3)
def ocr_page(page: str) -> str:
    return page.upper()


@step(name="doc_count_words")
def count_words(pages: list[str]) -> dict[str, int]:
    words = " ".join(pages).split()
    return {"pages": len(pages), "words": len(words)}


@workflow(name="doc_index")
def index(pages: Ref[list[str]]) -> NodeRef[dict[str, int]]:
    return count_words(pages)


@workflow(name="doc_pipeline")
def pipeline(document: Ref[dict[str, object]]) -> NodeRef[dict[str, int]]:
    pages = for_each(ocr_page, over=split(document), max_parallel=4)
    return child(index, pages)


if __name__ == "__main__":
    from cyclone_dsl import Client, Worker, embedded_database, migrate

    text = "Cyclone runs durable workflows on PostgreSQL. " * 8
    with embedded_database() as dsn:
        migrate(dsn)
        with Worker(dsn, [pipeline]), Client(dsn) as client:
            result = client.submit(pipeline, {"text": text}).result(timeout=30)
            print(result)
            assert result == {"pages": 5, "words": 48}
