"""Stand-in for vLLM's ``kv_connector.v1.base``: the classes the kvbridge connector imports."""


class KVConnectorMetadata:
    pass


class KVConnectorBase_V1:
    pass


class KVConnectorRole:
    SCHEDULER = 0
    WORKER = 1
