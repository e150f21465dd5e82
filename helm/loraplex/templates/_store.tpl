{{/*
The adapter-store sidecar container. Called with (dict "root" $ "native" BOOL): native
renders it as a Kubernetes native sidecar (an init container with restartPolicy Always).
*/}}
{{- define "loraplex.storeContainer" -}}
{{- $root := .root }}
{{- $native := .native }}
{{- $s := $root.Values.server }}
{{- $a := $root.Values.adapterStore }}
{{- $m := $root.Values.model }}
{{- $modelMount := include "loraplex.modelMount" $root }}
{{- $storeReadsModel := and $m.checkAdapterShapes (include "loraplex.modelIsHfFolder" $root) }}
- name: adapter-store
  image: {{ include "loraplex.storeImage" $root }}
  imagePullPolicy: {{ $root.Values.image.store.pullPolicy }}
  envFrom:
    - configMapRef:
        name: {{ include "loraplex.suffixed" (list (include "loraplex.fullname" $root) "store") }}
  env:
    - name: HOME
      value: /tmp
    {{- if and (eq $root.Values.redis.mode "external") $root.Values.redis.external.existingSecret }}
    - name: LORAPLEX_STORE_REDIS_URL
      valueFrom:
        secretKeyRef:
          name: {{ $root.Values.redis.external.existingSecret }}
          key: {{ $root.Values.redis.external.urlKey }}
    {{- end }}
    {{- if eq $a.blobs "s3" }}
    {{- include "loraplex.s3CredentialEnv" $root | nindent 4 }}
    {{- end }}
    {{- with $a.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: store-grpc
      containerPort: {{ $a.grpcPort }}
      protocol: TCP
    {{- if $a.metricsPort }}
    - name: store-metrics
      containerPort: {{ $a.metricsPort }}
      protocol: TCP
    {{- end }}
  startupProbe:
    grpc:
      port: {{ $a.grpcPort }}
    periodSeconds: 2
    failureThreshold: 60
  readinessProbe:
    grpc:
      port: {{ $a.grpcPort }}
    periodSeconds: 10
    timeoutSeconds: 2
  livenessProbe:
    grpc:
      port: {{ $a.grpcPort }}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  {{- if $native }}
  # A native sidecar (an init container that keeps running): Kubernetes starts it, and waits
  # for its startupProbe, before the server; it stops it only after the server has exited.
  restartPolicy: Always
  {{- else }}
  lifecycle:
    preStop:
      exec:
        # Outlive the server's drain: uploads and fetches in flight still reach the store.
        command: ["sleep", "{{ add $s.preStopDelaySeconds $s.drainSeconds }}"]
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml $a.resources | nindent 4 }}
  volumeMounts:
    - name: store-tmp
      mountPath: /tmp
    {{- if eq $a.blobs "local" }}
    - name: store-data
      mountPath: /var/lib/loraplex/store
    {{- end }}
    {{- if $storeReadsModel }}
    - name: model
      mountPath: {{ $modelMount }}
      readOnly: true
    {{- end }}
    {{- if $a.requireSecret }}
    - name: store-secret
      mountPath: {{ include "loraplex.secretsMount" $root }}/store
      readOnly: true
    {{- end }}
{{- end }}

{{/* "true" when the sidecar runs as a native sidecar (see adapterStore.nativeSidecar). */}}
{{- define "loraplex.nativeSidecar" -}}
{{- $mode := toString .Values.adapterStore.nativeSidecar }}
{{- if or (eq $mode "true") (and (eq $mode "auto") (semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version)) }}true{{ end }}
{{- end }}
