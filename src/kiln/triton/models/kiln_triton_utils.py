"""Helpers shared by kiln's Triton Python models: parameters, paths, request errors, streamed text.

kiln ships this file beside every Python model it writes into a repository (``<model>/1/kiln_triton_utils.py``,
byte-identical to this source); the Python backend puts the model's version directory on ``sys.path``, so
``model.py`` imports it as ``kiln_triton_utils``. kiln itself imports it as
``kiln.triton.models.kiln_triton_utils`` (the linter reads parameters with the same rules). It therefore imports
neither kiln nor ``triton_python_backend_utils`` at module level: only the standard library.
"""

import locale
import os
import traceback

#: Spellings a boolean parameter accepts (compared lower-cased).
TRUE_VALUES = frozenset({"1", "true", "t", "yes", "y", "on"})
FALSE_VALUES = frozenset({"0", "false", "f", "no", "n", "off"})
#: What a decoder returns for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


def use_utf8_locale():
    """Make ``open()`` & co. default to UTF-8: the stub runs Python in isolated mode with an ASCII locale.

    Call it at the top of ``model.py``, before the imports that read files (tokenizers, ModelOpt).
    """
    try:
        locale.setlocale(locale.LC_CTYPE, "")
    except locale.Error:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


class RequestError(ValueError):
    """A problem with one request; its message goes back to the client and the model keeps serving."""


# ---------------------------------------------------------------------------------------------- parameters
def parse_bool(value):
    """True or False for a boolean spelling (see TRUE_VALUES / FALSE_VALUES), None for anything else."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    return None


def parse_int(value):
    """The integer ``value`` spells, or None (absent or not an integer)."""
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def get_param(model_config, key, default=None):
    """A config.pbtxt parameter's string value, or ``default`` when absent, empty or an unfilled ``${...}``.

    ``model_config`` is the model configuration as Triton passes it to ``initialize`` (parsed JSON).
    """
    value = model_config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value.strip() == "" or value.strip().startswith("${"):
        return default
    return value.strip()


def get_bool_param(model_config, key, default):
    """A boolean parameter (true/false/1/0/yes/no/on/off); a malformed value is a configuration error."""
    value = get_param(model_config, key)
    if value is None:
        return default
    parsed = parse_bool(value)
    if parsed is None:
        raise ValueError(f"parameter {key!r} must be true or false, got {value!r}")
    return parsed


def get_int_param(model_config, key, default, minimum=None):
    """An integer parameter; a malformed or too small value is a configuration error."""
    value = get_param(model_config, key)
    if value is None:
        return default
    number = parse_int(value)
    if number is None:
        raise ValueError(f"parameter {key!r} must be an integer, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"parameter {key!r} must be at least {minimum}, got {number}")
    return number


def resolve_path(args, path):
    """A path parameter: absolute as given, relative to this model's directory (``args["model_repository"]``),
    so a packaged repository can be moved or mounted anywhere (e.g. at /models in a container)."""
    if path is None or os.path.isabs(path):
        return path
    return os.path.join(args.get("model_repository") or os.getcwd(), path)


# ---------------------------------------------------------------------------------------------- requests
def input_array(request, name):
    """The numpy value of the request's input ``name``, or None when the client did not send it."""
    import triton_python_backend_utils as pb_utils  # provided by the stub; imported here so kiln can import us

    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def requested(array, rule):
    """True when an optional input's value asks for a feature (``array`` is its numpy value, None when absent).

    ``rule``: ``"present"`` (sent at all), ``"true"`` (any element true), ``"nonempty"`` (any element, strings
    counted only when not empty), ``"nonzero"`` (any element not 0), or ``("not", value)`` (any element differs
    from the neutral ``value``). Duck-typed on numpy arrays so that this module needs only the standard library.
    """
    if array is None:
        return False
    if rule == "present":
        return True
    flat = array.reshape(-1)
    if flat.size == 0:
        return False
    if rule == "true":
        return bool(flat.any())
    if rule == "nonempty":
        return any(not (isinstance(v, (bytes, str)) and len(v) == 0) for v in flat)
    if rule == "nonzero":
        return bool((flat != 0).any())
    if isinstance(rule, tuple) and rule[0] == "not":
        return bool((flat != rule[1]).any())
    raise ValueError(f"unknown rule {rule!r}")


def refuse_unsupported(request, table):
    """Raise RequestError for the first input of ``table`` the request uses (see :func:`requested`).

    ``table`` maps an input name to ``(rule, message)``; the message names the feature and who cannot do it,
    e.g. ``"generation logits are not produced by the reference target"``. The input's name is appended.
    """
    for name, (rule, message) in table.items():
        if requested(input_array(request, name), rule):
            raise RequestError(f"{message} (input {name!r})")


def last_error_line():
    """The last line of the exception being handled (``ValueError: ...``): the part worth sending to a client."""
    return traceback.format_exc(limit=1).strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------- streamed text
def text_delta(text, sent_chars, final):
    """(new_text, new_sent_chars): what follows the ``sent_chars`` characters of ``text`` already sent.

    A trailing U+FFFD is a UTF-8 character whose bytes are still arriving: held back unless ``final``.
    """
    end = len(text)
    if not final:
        while end > sent_chars and text[end - 1] == REPLACEMENT:
            end -= 1
    if end <= sent_chars:
        return "", sent_chars
    return text[sent_chars:end], end
