"""gradcomp.testing: the contract every codec must pass, as a pytest plugin.

Run it on every registered codec (each example spec of ``gradcomp.codecs()``), on every backend
present (CPU; CUDA when torch sees a GPU), for float32, float16 and bfloat16 input::

    pytest --pyargs gradcomp.testing
    pytest --pyargs gradcomp.testing --codec 'topk:ratio=0.05' --codec fp16   # your own specs

What it checks (tests/cpp/test_contract.cpp is the C++ twin):
  * the spec round trip (``Codec(c.spec).spec == c.spec``; example specs are canonical);
  * ``packet_bytes`` a multiple of 16, the same on every call and equal to the layout's size; the
    layout's sections 16-byte aligned, in order, inside the packet; every other byte zero;
  * every single-field corruption of the 32-byte header (magic, version, codec id, input, wire
    and index dtypes, undefined flag bits, spec hash, numel, an exact main parameter) and a
    truncated buffer: ``CorruptPacketError`` on the CPU with nothing written, the status word's
    corrupt bit on CUDA (``gradcomp.check`` raises) with nothing written;
  * guard bytes around the packet, the workspace and the output never touched;
  * error feedback: ``r_new == fl(x' - divisor * D)`` bitwise (D the decoded packet, x' = fl(x +
    r_old), computed here with numpy float32 arithmetic), and ``x' == D + r_new`` exactly where
    the codec's properties say the subtraction is exact (``exact_residual``);
  * a NaN or inf in the input gives a non-finite decoded result, the header's non-finite flag and
    the status word's non-finite bit;
  * packets and residuals identical at 1, 2 and 3 CPU threads; sizes 0, 1, 7, 2^k +- 1;
  * two encodes on one workspace give the same packet; encode never touches the status word;
  * the EncodeContext key ``(seed, step, bucket, chunk)``: keyed codecs carry it in a 32-byte
    section (``Codec.packet_key`` reads it back; a non-zero reserved byte is refused), give the
    same packet on every call with the same key and another one for the next step; the others
    ignore it.
The references are numpy arithmetic and byte parsing written here, independent of gradcomp.
"""
