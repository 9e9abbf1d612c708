"""Parametrise the kernel test classes from their `CASES` (interpret/device runs) and `LOWER_CASES`
(Triton lowering) attributes, so the shared base's tests run over each subclass's own configurations."""


def pytest_generate_tests(metafunc):
    for arg, attr in (("case", "CASES"), ("lower_case", "LOWER_CASES")):
        if arg in metafunc.fixturenames:
            cases = getattr(metafunc.cls, attr)
            metafunc.parametrize(arg, cases, ids=[c.name for c in cases])
