"""What a parquet file's rows take once decoded, known before they are: from the footer,
and from a row group read compactly (its strings left dictionary-encoded).

A parquet file can be small and decode to a great deal: a long string stored once in a
dictionary and referred to by every row, runs of one value in a few bytes of RLE. Sizes
here are counted as the dataset reader counts a row (``agl.core.datasets``): 8 bytes
a value (a reference), plus the bytes of each string or binary value. They hold:

- ``compact_bound`` reads only the footer, and bounds what reading a row group with
  ``read_dictionary=byte_columns(...)`` holds (values, dictionaries and the encoded pages);
- ``row_sizes`` reads only what such a compact read holds: no string is expanded, so the
  sizes are known before any row is.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REFERENCE = 8  # bytes a value counts for, whatever else it holds

Sizes = npt.NDArray[np.int64]

# The logical types of the byte-array leaves read as dictionaries: others (a decimal
# stored as bytes) cannot be, and decode to a fixed size anyway.
_TEXT_TYPES = frozenset({"STRING", "JSON", "BSON", "ENUM", "NONE"})
_BINARY = (
    pa.types.is_binary,
    pa.types.is_string,
    pa.types.is_large_binary,
    pa.types.is_large_string,
    pa.types.is_fixed_size_binary,
)


def byte_columns(schema: pq.ParquetSchema) -> list[str]:
    """The paths of the string and binary leaves: read as dictionaries, a string repeated
    in every row is held once."""
    columns = (schema.column(i) for i in range(len(schema)))
    return [
        c.path
        for c in columns
        if c.physical_type == "BYTE_ARRAY" and c.logical_type.type in _TEXT_TYPES
    ]


def compact_bound(metadata: pq.FileMetaData, schema: pq.ParquetSchema) -> int:
    """What the footer says the compact read of every row group holds: for each column
    chunk, its pages once uncompressed, or a reference per value (nulls and empty lists
    included) plus a fixed-size binary's bytes, whichever is more."""
    widths = [_width(schema.column(i)) for i in range(len(schema))]
    total = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for i, width in enumerate(widths):
            chunk = row_group.column(i)
            total += max(chunk.total_uncompressed_size, chunk.num_values * (REFERENCE + width))
    return total


def _width(column: pq.ColumnSchema) -> int:
    return column.length if column.physical_type == "FIXED_LEN_BYTE_ARRAY" else 0


def row_sizes(table: pa.Table) -> Sizes:
    """Each row's decoded size; ``table`` read compactly. ValueError for a column of a
    type no parquet reader makes (a union)."""
    sizes = np.zeros(table.num_rows, dtype=np.int64)
    for column in table.itercolumns():
        chunks = [value_sizes(chunk) for chunk in column.chunks]
        if chunks:  # none where there are no rows
            sizes += np.concatenate(chunks)
    return sizes


def value_sizes(array: pa.Array) -> Sizes:
    """The decoded size of each value of ``array``, from its compact form."""
    kind = array.type
    if isinstance(array, pa.ExtensionArray):
        return value_sizes(array.storage)
    if isinstance(array, pa.DictionaryArray):
        entries = pa.array(value_sizes(array.dictionary))
        return np.asarray(pc.take(entries, array.indices).fill_null(REFERENCE), dtype=np.int64)
    if isinstance(array, pa.StructArray):
        return REFERENCE + sum(
            (value_sizes(field) for field in array.flatten()), np.zeros(len(array), np.int64)
        )
    if isinstance(array, pa.FixedSizeListArray):
        size = kind.list_size
        children = value_sizes(array.values)[
            array.offset * size : (array.offset + len(array)) * size
        ]
        return REFERENCE + children.reshape(len(array), size).sum(axis=1, dtype=np.int64)
    if isinstance(
        array, pa.ListArray | pa.LargeListArray | pa.ListViewArray | pa.LargeListViewArray
    ):
        return REFERENCE + _list_sums(array, value_sizes(array.values))
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        return value_sizes(array.cast(pa.large_binary()))
    if any(test(kind) for test in _BINARY):
        lengths = pc.binary_length(array).fill_null(0)
        return REFERENCE + np.asarray(lengths, dtype=np.int64)
    if pa.types.is_nested(kind):
        raise ValueError(f"a column of type {kind}")
    return np.full(len(array), REFERENCE, dtype=np.int64)


def _list_sums(array: pa.Array, children: Sizes) -> Sizes:
    """Each list's sum of ``children`` (the sizes of ``array.values``, whole); a null list
    sums to 0, whatever its offsets point at."""
    offsets = np.asarray(array.offsets, dtype=np.int64)
    if isinstance(array, pa.ListViewArray | pa.LargeListViewArray):
        starts, ends = offsets, offsets + np.asarray(array.sizes, dtype=np.int64)
    else:
        starts, ends = offsets[:-1], offsets[1:]
    valid = np.asarray(array.is_valid(), dtype=bool)
    prefix = np.concatenate([[0], np.cumsum(children, dtype=np.int64)])
    return np.where(valid, prefix[np.where(valid, ends, 0)] - prefix[np.where(valid, starts, 0)], 0)
