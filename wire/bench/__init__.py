"""The wire benchmark (`python -m triode.wire.bench`, `triode bench wire`): the msgspec codec
against pickle (`cases`), and the trio ZMQ adapter against raw pyzmq, each client against an
echo peer process (`transport`, `peer`), in one table (`report`); `cli` runs it and says how.
"""

from .cli import Options as Options
from .cli import main as main
from .cli import run as run
from .report import Result as Result
from .report import format_table as format_table
from .report import percentile as percentile
