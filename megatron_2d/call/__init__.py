"""One call of the op: its options (:class:`~megatron_2d.call.options.AttentionOptions`, frozen and hashable) and
its plan (:func:`~megatron_2d.call.plan.prepare`: head route and ring context, built once per key, held in a bounded
cache owned by the groups)."""
