#!/usr/bin/env python3
# Doxygen INPUT_FILTER for the course Markdown: GitHub math ($..$, $$..$$, ```math) -> Doxygen \f$ \f[.
r"""How math is written in the course's Markdown, and how the Doxygen site gets it.

Write math the way GitHub renders it, so that the same file reads well on GitHub, in editors and
on the site:

* inline: ``$x_i$``. No space after the opening ``$`` or before the closing one, the whole formula
  on one line, a space (or an opening parenthesis) before it and no letter or digit right after it.
  Do not put a formula inside ``"..."`` (Doxygen prints quoted text raw) or in a heading (Doxygen
  prints heading text raw): write the heading in words.
  Likewise no code span in the text of a link to another ``.md`` page (``[`x.md`](x.md)``):
  Doxygen prints its backticks.
* display: a fenced block whose info string is ``math`` (its text is taken literally by GitHub)::

      ```math
      m = \max_i x_i
      ```

  ``$$`` on lines of their own works here too, but GitHub applies Markdown escapes inside ``$$``
  and ``$`` math, so ``\{`` loses its backslash there.  Inside ``$..$`` avoid backslash before
  ASCII punctuation: write ``\lbrace``/``\rbrace``, ``\thinspace``, ``\Vert``; ``\_`` belongs in
  a ```math block or in a code span.
* a literal dollar sign in prose is ``\$``; anything in a code span or a code fence is code, and
  shell variables (``$HOME``, ``$(BUILD)``) belong there.
* a heading may hold code spans: Doxygen prints heading text as plain text (``<tt>`` would show),
  so the filter drops their backticks there; ``## Task 2 — `merge` `` reads "Task 2 — merge".
* a code span may contain ``'``: the filter doubles its backticks, since Doxygen reads a
  single-backtick span with a ``'`` in it as a `quotation' (LaTeX style).
* bold (``**...**``) may start or end with code or math: this filter writes every bold span as
  ``<b>..</b>``, which Doxygen renders in every position (its own Markdown does not open or close
  ``**`` next to a backtick or a formula).
* a link to a section of another page, ``[table](../../docs/performance.md#perf-amd-debian12)``,
  names the section by an ``<a id="perf-amd-debian12"></a>`` on that page. Doxygen leaves such a
  link as it is (a dead link on the site), so the filter writes it ``[table](#perf-amd-debian12)``:
  Doxygen's anchors are global, it finds the page itself, and fails the build on an anchor that
  no page has.

docs/Doxyfile.in runs this script on every *.md file (FILTER_PATTERNS). It writes the file to
stdout with the same number of lines, ``$..$`` turned into ``\f$..\f$``, ``$$``/```math blocks
into ``\f[..\f]`` and bold into ``<b>``; code spans, fenced code and ``\$`` are left alone.
MathJax 2 gets the AMS extensions (``\operatorname``, ``\tfrac``) from MATHJAX_EXTENSIONS.

``md_math_filter.py --check FILE...`` lists the places GitHub is likely to render wrongly (see
above) and exits 1 if there are any.
"""
import re
import sys

FENCE = re.compile(r'^(\s*(?:>\s*)*)(`{3,}|~{3,})\s*([^`\s]*)')
# $(BUILD), ${HOME}, $CUDA_HOME, $PATH: a shell variable, not a formula.
SHELLISH = re.compile(r'^([({]?[A-Z][A-Z0-9]+_[A-Z0-9_]+|[({][A-Z][A-Z0-9_]{2,}[)}]|[A-Z]{4,})'
                      r'(?=[\s/.,:;)}]|$)')
ESCAPED_PUNCT = re.compile(r'\\[!-/:-@\[-`{-~]')
HEADING = re.compile(r'^ {0,3}#{1,6}(\s|$)')
# ](../../docs/performance.md#perf-amd-debian12): a section of another page
PAGE_ANCHOR = re.compile(r'\]\((?![a-z]+://)[^)\s#]*\.md#([A-Za-z][\w-]*)\)')


class Block:
    """Inline conversion of one paragraph (a run of lines without blank lines or fences)."""

    def __init__(self, text, check):
        self.s, self.check, self.out, self.notes = text, check, [], []

    def note(self, i, msg):
        line = self.s.count('\n', 0, i)
        self.notes.append((line, msg))

    def run(self):
        s, i, n = self.s, 0, len(self.s)
        bold = []  # indices into self.out of '**' tokens outside code and math
        while i < n:
            c = s[i]
            if c == '\\' and i + 1 < n:
                self.out.append(s[i:i + 2])
                i += 2
            elif c == '`':
                j = i
                while j < n and s[j] == '`':
                    j += 1
                run = s[i:j]
                m = re.compile(r'(?<!`)' + run + r'(?!`)').search(s, j)
                end = m.end() if m else j
                code = s[i:end]
                if m and run == '`' and "'" in code and '`' not in code[1:-1]:
                    code = '``' + code[1:-1] + '``'  # Doxygen reads `text' as a quotation
                self.out.append(code)
                i = end
            elif c == '$':
                i = self.math(i)
            elif s.startswith('](', i) and PAGE_ANCHOR.match(s, i):
                m = PAGE_ANCHOR.match(s, i)
                self.out.append('](#' + m.group(1) + ')')
                i = m.end()
            elif s.startswith('**', i) and not s.startswith('***', i):
                bold.append(len(self.out))
                self.out.append('**')
                i += 2
            else:
                self.out.append(c)
                i += 1
        self.bold(bold)
        return ''.join(self.out)

    def math(self, i):
        s, n = self.s, len(self.s)
        prev = s[i - 1] if i > 0 else ' '
        if s.startswith('$$', i):  # $$...$$ inside a paragraph
            j = s.find('$$', i + 2)
            if j > i + 2:
                self.out.append('\\f[' + s[i + 2:j] + '\\f]')
                return j + 2
        elif s.startswith('$`', i):  # GitHub's $`...`$
            j = s.find('`$', i + 2)
            if j > i + 2 and '\n' not in s[i:j]:
                self.out.append('\\f$' + s[i + 2:j] + '\\f$')
                return j + 2
        elif i + 1 < n and not s[i + 1].isspace() and not prev.isalnum():
            j = i + 1
            while j < n and s[j] not in '$\n':
                j += 2 if s[j] == '\\' else 1
            body = s[i + 1:j]
            after = s[j + 1] if j + 1 < n else ' '
            if (j < n and s[j] == '$' and not s[j - 1].isspace() and not after.isalnum()
                    and '`' not in body and not SHELLISH.match(body)):
                if self.check:
                    self.lint(i, prev, after, body)
                self.out.append('\\f$ ' + body + ' \\f$')
                return j + 1
        self.out.append('$')
        return i + 1

    def lint(self, i, prev, after, body):
        if not (prev.isspace() or prev in '(*|'):
            self.note(i, 'math right after %r: GitHub may not render it' % prev)
        if prev == '"':
            self.note(i, 'math in "quotes": Doxygen prints it raw')
        for e in ESCAPED_PUNCT.findall(body):
            self.note(i, 'inline math %s: GitHub drops the backslash' % e)

    def bold(self, marks):
        """Pairs '**' openers and closers (CommonMark flanking, simplified) and writes <b>."""
        out, opener = self.out, None
        for k in marks:
            before = out[k - 1][-1:] if k > 0 else ' '
            after = out[k + 1][:1] if k + 1 < len(out) else ' '
            if opener is not None and not before.isspace():
                out[opener], out[k], opener = '<b>', '</b>', None
            elif after and not after.isspace():
                opener = k


def convert(text, check=False):
    lines, out, notes = text.split('\n'), [], []
    para, fence, display = [], None, None
    base = [0]

    def flush():
        if para:
            b = Block('\n'.join(para), check)
            out.extend(b.run().split('\n'))
            notes.extend((base[0] + ln, msg) for ln, msg in b.notes)
            para.clear()

    for no, line in enumerate(lines):
        m = FENCE.match(line)
        if fence:  # inside ``` or ~~~
            if m and m.group(2)[0] == fence[0][0] and len(m.group(2)) >= len(fence[0]) \
                    and not line[m.end():].strip():
                out.append(line.replace(m.group(2), '\\f]', 1) if fence[1] else line)
                fence = None
            else:
                out.append(line)
            continue
        if display:  # inside $$ ... $$
            if line.rstrip().endswith('$$'):
                out.append(line.rstrip()[:-2] + '\\f]')
                display = None
            else:
                out.append(line)
            continue
        stripped = line.strip()
        if m:
            flush()
            math = m.group(3) == 'math'
            fence = (m.group(2), math)
            out.append(line[:m.start(2)] + '\\f[' if math else line)
            continue
        if stripped.startswith('$$') and not para:
            flush()
            body = line.replace('$$', '\\f[', 1)
            if stripped.endswith('$$') and len(stripped) >= 4:
                out.append(body.rstrip()[:-2] + '\\f]')
            else:
                out.append(body)
                display = True
            continue
        if not stripped:
            flush()
            out.append(line)
            base[0] = no + 1
            continue
        if check and stripped.startswith('#') and re.search(r'\$\S', stripped):
            notes.append((no, 'math in a heading: Doxygen prints it raw'))
        if check and re.search(r'\[[^\]]*`[^\]]*\]\([^)\s]*\.md\b', line):
            notes.append((no, 'code span in the text of a link to a .md page: Doxygen prints the backticks'))
        if HEADING.match(line):  # Doxygen prints a heading as plain text: `code` would show <tt>
            flush()
            out.append(re.sub(r'(`+)(.+?)\1', r'\2', line))
            base[0] = no + 1
            continue
        if not para:
            base[0] = no
        para.append(line)
    flush()
    return '\n'.join(out), notes


def main(argv):
    if argv[:1] == ['--check']:
        bad = 0
        for path in argv[1:]:
            with open(path, encoding='utf-8') as f:
                for line, msg in convert(f.read(), check=True)[1]:
                    print('%s:%d: %s' % (path, line + 1, msg))
                    bad += 1
        return 1 if bad else 0
    with open(argv[0], encoding='utf-8') as f:
        sys.stdout.write(convert(f.read())[0])
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
