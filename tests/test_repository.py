"""The repository stays a product: a README that is a page for users, and
no tracked file that narrates the project's own development."""
import os.path as osp
import re
import subprocess

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
README_MAX_LINES = 250
# a development session, or the machine it ran on; pytest's fixture scope
# is the one legitimate use of the word
DEVELOPMENT_LOG = re.compile(r'\bsessions?\b|\bthis VM\b', re.IGNORECASE)
PYTEST_SCOPE = re.compile(r'''scope\s*=\s*['"]session['"]''')


def tracked_text_files():
    """(path, text) of every tracked file that is text (not this test,
    which names what it looks for)."""
    names = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split('\0')
    for name in filter(None, names):
        path = osp.join(ROOT, name)
        if osp.samefile(path, __file__) or not osp.isfile(path):
            continue
        with open(path, 'rb') as f:
            data = f.read()
        if b'\0' in data:
            continue  # binary (images)
        yield name, data.decode('utf-8', errors='replace')


def test_readme_is_at_most_250_lines():
    with open(osp.join(ROOT, 'README.md'), encoding='utf-8') as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f'README.md has {len(lines)} lines; longer material goes to docs/')


def test_no_tracked_file_mentions_a_development_session():
    found = []
    for name, text in tracked_text_files():
        for number, line in enumerate(text.splitlines(), 1):
            if DEVELOPMENT_LOG.search(PYTEST_SCOPE.sub('', line)):
                found.append(f'{name}:{number}: {line.strip()}')
    assert not found, '\n'.join(found)


def test_the_checks_catch_what_they_look_for():
    assert DEVELOPMENT_LOG.search('measured in Session 29')
    assert DEVELOPMENT_LOG.search('on this VM')
    assert not DEVELOPMENT_LOG.search(
        PYTEST_SCOPE.sub('', "@pytest.fixture(scope='session')"))
