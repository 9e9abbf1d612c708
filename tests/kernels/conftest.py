"""Parametrise the kernel test classes from their `CASES` (interpret/device runs), `PAGED_CASES` ((case, page
size) pairs, run through a block table) and `LOWER_CASES` (Triton lowering) attributes, so the shared base's
tests run over each subclass's own configurations."""


def pytest_generate_tests(metafunc):
    if "paged" in metafunc.fixturenames:
        cases = metafunc.cls.PAGED_CASES
        metafunc.parametrize("paged", cases, ids=[f"{c.name}-page{p}" for c, p in cases])
    for arg, attr in (("case", "CASES"), ("lower_case", "LOWER_CASES")):
        if arg in metafunc.fixturenames:
            cases = getattr(metafunc.cls, attr)
            metafunc.parametrize(arg, cases, ids=[c.name for c in cases])
