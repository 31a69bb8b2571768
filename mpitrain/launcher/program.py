"""The program mpitrainrun is asked to run on every rank, checked before
mpirun starts: a misspelt program or a missing script would otherwise start
every rank only to have each fail with the same message, followed by
Open MPI's report of the job's end.
"""

import os
import re
import shutil


def check_program(parser, command, env):
    """Refuse a program, or the script a python is given, that is not there,
    before mpirun starts ranks only to have each of them fail."""
    program = command[0]
    if os.sep in program:
        if not os.path.exists(program):
            parser.error(f"{program} does not exist")
    elif shutil.which(program, path=env.get("PATH")) is None:
        parser.error(f"{program!r} is not a program on PATH; give its path, "
                     "e.g. mpitrainrun -np 2 python train.py")
    script = python_script(command)
    if script is not None and not os.path.exists(script):
        where = "" if os.path.isabs(script) else f" in {os.getcwd()}"
        parser.error(f"the script {script} does not exist{where}")


def python_script(command):
    """The script of `python [options] script.py ...`, or None (-c, -m, stdin,
    or a program that is not python). Short options may come in clusters,
    as in -uW ignore: -W and -X take the rest of the word or the next one."""
    if not re.fullmatch(r"python[\d.]*", os.path.basename(command[0])):
        return None
    words = iter(command[1:])
    for word in words:
        if word == "-":
            return None
        if word == "--check-hash-based-pycs":
            next(words, None)
        elif not word.startswith("-"):
            return word
        elif not word.startswith("--"):
            for at, letter in enumerate(word[1:], 1):
                if letter in "cm":
                    return None
                if letter in "WX":
                    if at == len(word) - 1:
                        next(words, None)
                    break
    return None
