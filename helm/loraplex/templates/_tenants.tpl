{{/*
Tenants: the tokens Secret, TLS Secrets, the store's shared secret, and their mounts.
Secrets are mounted as whole volumes (no subPath), so an edited tokens Secret reaches the
running server, which reloads the file without a restart.
*/}}
{{- define "loraplex.secretsMount" -}}/var/lib/loraplex/secrets{{- end }}

{{/* The Secret store-secret.yaml makes (none with adapterStore.existingSecret). */}}
{{- define "loraplex.storeSecretName" -}}{{ include "loraplex.suffixed" (list (include "loraplex.fullname" .) "store-secret") }}{{- end }}

{{- define "loraplex.tlsOn" -}}{{ if .Values.tls.secretName }}true{{ end }}{{- end }}

{{/* The port the kubelet probes: the plaintext health-only port when the gRPC port is TLS. */}}
{{- define "loraplex.probePort" -}}
{{- if include "loraplex.tlsOn" . }}{{ .Values.tls.healthPort }}{{ else }}{{ .Values.server.grpcPort }}{{ end }}
{{- end }}

{{- define "loraplex.validateTenants" -}}
{{- $v := .Values }}
{{- if and (eq $v.auth.mode "tokens") (not $v.auth.tokensSecret) }}
{{- fail "auth.mode=tokens needs auth.tokensSecret: an existing Secret whose auth.tokensKey holds the tokens file (sha256 hashes; `loraplex hash-token`)" }}
{{- end }}
{{- if and $v.tls.clientCaSecret (not $v.tls.secretName) }}
{{- fail "tls.clientCaSecret (client certificates) needs tls.secretName (the server's certificate)" }}
{{- end }}
{{- if and $v.adapterStore.existingSecret (not $v.adapterStore.requireSecret) }}
{{- fail "adapterStore.existingSecret holds the shared secret of adapterStore.requireSecret=true: set requireSecret=true, or leave existingSecret empty" }}
{{- end }}
{{- end }}

{{/* LORAPLEX_* settings of the server for auth, TLS and tenant limits (configmap.yaml). */}}
{{- define "loraplex.tenantSettings" -}}
{{- $v := .Values }}
{{- $dir := include "loraplex.secretsMount" . }}
LORAPLEX_AUTH: {{ $v.auth.mode | quote }}
{{- if eq $v.auth.mode "tokens" }}
LORAPLEX_TOKENS_FILE: {{ printf "%s/tokens/%s" $dir $v.auth.tokensKey | quote }}
{{- end }}
{{- if include "loraplex.tlsOn" . }}
LORAPLEX_TLS_CERT_FILE: {{ printf "%s/tls/tls.crt" $dir | quote }}
LORAPLEX_TLS_KEY_FILE: {{ printf "%s/tls/tls.key" $dir | quote }}
LORAPLEX_HEALTH_PORT: {{ $v.tls.healthPort | quote }}
{{- if $v.tls.clientCaSecret }}
LORAPLEX_TLS_CLIENT_CA_FILE: {{ printf "%s/client-ca/ca.crt" $dir | quote }}
{{- end }}
{{- end }}
{{- if $v.adapterStore.requireSecret }}
LORAPLEX_ADAPTER_STORE_SECRET_FILE: {{ printf "%s/store/secret" $dir | quote }}
{{- end }}
{{- with $v.tenantLimits }}
LORAPLEX_TENANT_MAX_CONCURRENT_REQUESTS: {{ .maxConcurrentRequests | int64 | quote }}
LORAPLEX_TENANT_MAX_QUEUED_REQUESTS: {{ .maxQueuedRequests | int64 | quote }}
LORAPLEX_TENANT_TOKENS_PER_MINUTE: {{ .tokensPerMinute | int64 | quote }}
LORAPLEX_TENANT_MAX_ADAPTER_BYTES: {{ .maxAdapterBytes | int64 | quote }}
LORAPLEX_TENANT_MAX_ADAPTERS: {{ .maxAdapters | int64 | quote }}
{{- end }}
{{- end }}

{{/* volumeMounts of the server container. */}}
{{- define "loraplex.serverSecretMounts" -}}
{{- $v := .Values }}
{{- $dir := include "loraplex.secretsMount" . }}
{{- if eq $v.auth.mode "tokens" }}
- name: auth-tokens
  mountPath: {{ $dir }}/tokens
  readOnly: true
{{- end }}
{{- if include "loraplex.tlsOn" . }}
- name: tls
  mountPath: {{ $dir }}/tls
  readOnly: true
{{- if $v.tls.clientCaSecret }}
- name: tls-client-ca
  mountPath: {{ $dir }}/client-ca
  readOnly: true
{{- end }}
{{- end }}
{{- if $v.adapterStore.requireSecret }}
- name: store-secret
  mountPath: {{ $dir }}/store
  readOnly: true
{{- end }}
{{- end }}

{{/* The pod's secret volumes. */}}
{{- define "loraplex.tenantVolumes" -}}
{{- $v := .Values }}
{{- if eq $v.auth.mode "tokens" }}
- name: auth-tokens
  secret:
    secretName: {{ $v.auth.tokensSecret }}
    defaultMode: 0444
{{- end }}
{{- if include "loraplex.tlsOn" . }}
- name: tls
  secret:
    secretName: {{ $v.tls.secretName }}
    defaultMode: 0444
{{- if $v.tls.clientCaSecret }}
- name: tls-client-ca
  secret:
    secretName: {{ $v.tls.clientCaSecret }}
    defaultMode: 0444
{{- end }}
{{- end }}
{{- if $v.adapterStore.requireSecret }}
- name: store-secret
  secret:
    {{- with $v.adapterStore.existingSecret }}
    secretName: {{ . }}
    items:
      - key: {{ $v.adapterStore.existingSecretKey }}
        path: secret
    {{- else }}
    secretName: {{ include "loraplex.storeSecretName" . }}
    {{- end }}
    defaultMode: 0444
{{- end }}
{{- end }}
