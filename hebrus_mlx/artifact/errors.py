"""Typed artifact errors. Every error names the field that failed so a
diagnostic is actionable ("ple.rows", not "bad file")."""

from ..errors import HebrusError


class ArtifactError(HebrusError):
    """Base class. `field` is a dotted name of the offending field."""


class HeaderError(ArtifactError):
    """A header is malformed: magic, version, bounds, arithmetic."""


class GeometryError(ArtifactError):
    """Geometry disagrees with the family descriptor or with itself."""


class CodecError(ArtifactError):
    """The codec is unknown or cannot represent a row exactly (AFN-002)."""


class FamilyError(ArtifactError):
    """No registered family matches exactly."""


class DigestError(ArtifactError):
    """A SHA-256 digest does not match the bytes it covers."""


class TruncatedError(ArtifactError):
    """A read returned fewer bytes than the structure requires."""


class AdmissionError(ArtifactError):
    """An admission boundary rejected the artifact."""


class PublishError(ArtifactError):
    """Atomic publication failed. `committed` says whether the new target
    became visible (only a post-rename directory fsync can fail that way)."""

    def __init__(self, field, message, committed=False):
        self.committed = committed
        super().__init__(field, message)
