"""The committed gRPC API reference (docs/reference/grpc.md) is what scripts/grpc_reference.py makes from
the .proto files now, and it documents every service, RPC, message, enum and commented field."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("grpc_reference", ROOT / "scripts" / "grpc_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)
PAGE = ROOT / "docs" / "reference" / "grpc.md"
FIX = "docs/reference/grpc.md is stale: run proto/generate.sh (with the project's .venv) and commit docs/reference/"


@pytest.fixture(scope="module")
def descriptors():
    return reference.compile_protos()


@pytest.fixture(scope="module")
def page(descriptors):
    return reference.Page(descriptors).render()


def test_committed_page_matches_a_fresh_generation(page):
    assert PAGE.is_file(), f"docs/reference/grpc.md is missing: {FIX}"
    committed = PAGE.read_text()
    if committed != page:
        first = next(
            (n for n, (a, b) in enumerate(zip(committed.splitlines(), page.splitlines()), 1) if a != b),
            min(len(committed.splitlines()), len(page.splitlines())) + 1,
        )
        pytest.fail(f"{FIX}\nfirst difference at line {first}")


def _message_expectations(message, prefix, path, comments):
    """(what, text) pairs the page must hold for a message, its fields and what it nests."""
    if message.options.map_entry:
        return
    name = f"{prefix}{message.name}"
    yield "message heading", f'<a id="{name}"></a>\n\n### {name}\n'
    if path in comments:
        yield f"comment of message {name}", comments[path].text()
    for index, field in enumerate(message.field):
        yield f"field {name}.{field.name}", f"| `{field.name}` | "
        if (comment := comments.get(path + (reference.FIELD, index))) is not None:
            yield f"comment of {name}.{field.name}", f" | {reference._cell(comment.text())} |"
    for index, nested in enumerate(message.nested_type):
        yield from _message_expectations(nested, f"{name}.", path + (reference.NESTED_TYPE, index), comments)
    for enum in message.enum_type:
        yield "nested enum", f'<a id="{name}.{enum.name}"></a>'


def _file_expectations(file):
    """(what, text) pairs the page must hold for one .proto file."""
    comments = reference._comments(file)
    yield "file section", f"## {Path(file.name).name}"
    for s, service in enumerate(file.service):
        yield "service anchor", f'<a id="{service.name}"></a>'
        for m, method in enumerate(service.method):
            yield "RPC", f'<a id="{service.name}.{method.name}"></a>`{method.name}`'
            if (comment := comments.get((reference.SERVICE, s, reference.METHOD, m))) is not None:
                yield f"comment of {service.name}.{method.name}", reference._cell(comment.text())
    for index, message in enumerate(file.message_type):
        yield from _message_expectations(message, "", (reference.MESSAGE_TYPE, index), comments)
    for enum in file.enum_type:
        yield "enum", f'<a id="{enum.name}"></a>'
        for value in enum.value:
            yield f"value of {enum.name}", f"| `{value.name}` | {value.number} |"


def test_page_has_every_service_rpc_message_enum_and_commented_field(descriptors, page):
    files = [file for file in descriptors.file if file.package == reference.PACKAGE]
    names = {Path(file.name).name for file in files}
    assert names >= {"common.proto", "specdecode.proto", "draft.proto", "target.proto"}
    expected = [pair for file in files for pair in _file_expectations(file)]
    assert len(expected) > 150  # every field of the four files, at least
    missing = [f"{what}: {text!r}" for what, text in expected if text not in page]
    assert not missing, "the reference page lacks:\n" + "\n".join(missing)


def test_the_client_facing_service_streams_and_internal_services_are_marked(page):
    assert "| [`GenerateRequest`](#GenerateRequest) | stream [`GenerateResponse`](#GenerateResponse) |" in page
    assert "### service DraftService (internal)" in page and "### service TargetService (internal)" in page
    assert "### service SpecDecode\n" in page
    assert "`map<uint32, float>` | 8 | map |" in page  # SamplingParams.logit_bias
    assert "| `seed` | `uint64` | 4 | optional |" in page  # SamplingParams.seed (proto3 optional)


def _slug(heading: str) -> str:
    """Python-Markdown's toc slugify (mkdocs.yml's `toc`): the anchor a heading gets."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_every_link_on_the_page_resolves(page):
    """As `mkdocs build --strict` (validation: anchors) would: links within the page hit an anchor it
    has, links to other pages hit a file and one of its headings."""
    ids = set(re.findall(r'<a id="([^"]+)"></a>', page))
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page):
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in ids:
                broken.append(target)
            continue
        other = (PAGE.parent / path).resolve()
        if not other.is_file():
            broken.append(f"{target} (no such page)")
        elif anchor:
            headings = re.findall(r"^#{1,6} (.+?)\s*#*$", other.read_text(), re.MULTILINE)
            if anchor not in {_slug(heading) for heading in headings}:
                broken.append(f"{target} (no such heading)")
    assert not broken, "broken links on docs/reference/grpc.md:\n" + "\n".join(broken)
